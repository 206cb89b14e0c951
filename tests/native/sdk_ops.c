/* Test operators for tests/test_native_ops.py: each exercises SDK calls and
 * reports what it saw in its output buffer.  The input buffer holds the
 * op's parameters (struct args). */
#include <dspx/dsp.h>
#include <stdlib.h>

struct args {
    uint64_t addr;  /* a DSP address to map */
    uint32_t size;  /* bytes */
    int32_t mode;   /* op-specific */
    int32_t i[16];  /* op-specific integers */
};

/* 0x5001: map [addr, addr+size), copy it to the output, unmap (mode 0: by
 * pointer, 1: by its low 32 bits as the seed does, 2: twice). */
static int op_map(void *input, void *output, void *tm) {
    (void)tm;
    struct args *a = input;
    uint8_t *p = hb_dsp_mem_map(a->addr, a->size);
    PRT_IF_COND_RETURN(MAP_FAILED == p, HB_ERR_MMAP_FAILED)
    memcpy(output, p, a->size);
    int rc = a->mode == 1 ? hb_dsp_mem_unmap((uint32_t)(uintptr_t)p) : hb_dsp_mem_unmap((uintptr_t)p);
    if (a->mode == 2)
        rc = hb_dsp_mem_unmap((uintptr_t)p);
    return rc;
}

/* 0x5002: allocate i[0] tiles: sizes i[1+2k], bank i[2+2k], alignment
 * mode & ~1 (64 if 0); output: their int64 addresses (-1 for NULL); then
 * frees them all (mode bit 0: frees the first once more). */
static int op_tiles(void *input, void *output, void *tm) {
    struct args *a = input;
    int64_t *out = output;
    void *t[8];
    int n = a->i[0], failed = 0;
    for (int k = 0; k < n; k++) {
        t[k] = xvAllocateBuffer(tm, a->i[1 + 2 * k], a->i[2 + 2 * k], a->mode & ~1 ? a->mode & ~1 : 64);
        out[k] = t[k] ? (int64_t)(uintptr_t)t[k] : -1;
        failed |= t[k] == NULL;
    }
    for (int k = 0; k < n; k++)
        if (t[k])
            xvFreeBuffer(tm, t[k]);
    if (a->mode & 1)
        return xvFreeBuffer(tm, t[0]);
    return failed ? -3 : 0;
}

/* 0x5003: DMA DDR -> tile -> output through IDMA_COPY/IDMA_WAIT; mode picks a misuse. */
static int op_dma(void *input, void *output, void *tm) {
    struct args *a = input;
    int32_t ret = 0;
    uint8_t *src = hb_dsp_mem_map(a->addr, a->size);
    if (src == MAP_FAILED)
        return HB_ERR_MMAP_FAILED;
    IDMA_WAIT(HB_IDMA_CH1, ret) /* nothing in flight: returns at once */
    if (ret != 0)
        return 100;
    uint8_t *tile = xvAllocateBuffer(tm, (int32_t)a->size, XV_MEM_BANK_COLOR_1, 64);
    if (tile == NULL)
        return -3;
    switch (a->mode) {
    case 1: IDMA_COPY(2, ret, src, tile, a->size) break;                  /* no such channel */
    case 2: IDMA_COPY(HB_IDMA_CH0, ret, src, tile, 0) break;              /* no bytes */
    case 3: IDMA_COPY(HB_IDMA_CH0, ret, src, tile, a->size + 64) break;   /* past the tile */
    case 4: IDMA_COPY(HB_IDMA_CH0, ret, src, (uint8_t *)output + (1 << 30), a->size) break; /* nowhere */
    case 5: xvFreeBuffer(tm, tile); IDMA_COPY(HB_IDMA_CH0, ret, src, tile, a->size) break; /* a dead tile */
    case 6: IDMA_WAIT(5, ret) break;
    default:
        IDMA_COPY(HB_IDMA_CH0, ret, src, tile, a->size)
        if (ret < 0) return ret;
        IDMA_WAIT(HB_IDMA_CH0, ret)
        IDMA_COPY(HB_IDMA_CH1, ret, tile, output, a->size)
        if (ret < 0) return ret;
        IDMA_WAIT(HB_IDMA_CH1, ret)
        hb_dsp_mem_unmap((uintptr_t)src);
        return ret;
    }
    return ret < 0 ? ret : 0;
}

/* 0x5004: a C7x auto-increment transfer from DDR to the output: i[0] sync
 * type, i[1..4] source icnt0..3, i[5..7] sdim1..3, i[8..11] dest icnt,
 * i[12..14] ddim1..3; mode bit 0: through an L2 tile, bit 1: trigger once too often.
 * Returns the number of triggers it made. */
static int op_autoinc(void *input, void *output, void *tm) {
    struct args *a = input;
    uint8_t *src = hb_dsp_mem_map(a->addr, a->size);
    if (src == MAP_FAILED)
        return HB_ERR_MMAP_FAILED;
    uint8_t *dst = output, *tile = NULL;
    size_t out_bytes = dspx_output_size();
    if (a->mode & 1) {
        tile = xvAllocateBuffer(tm, (int32_t)out_bytes, XV_MEM_BANK_COLOR_0, 64);
        if (tile == NULL) return -3;
        memset(tile, 0, out_bytes);
        dst = tile;
    }
    DmaUtilsAutoInc3d_TransferProp p;
    memset(&p, 0, sizeof p);
    p.syncType = a->i[0];
    p.transferDim.sicnt0 = a->i[1]; p.transferDim.sicnt1 = a->i[2];
    p.transferDim.sicnt2 = a->i[3]; p.transferDim.sicnt3 = a->i[4];
    p.transferDim.sdim1 = a->i[5]; p.transferDim.sdim2 = a->i[6]; p.transferDim.sdim3 = a->i[7];
    p.transferDim.dicnt0 = a->i[8]; p.transferDim.dicnt1 = a->i[9];
    p.transferDim.dicnt2 = a->i[10]; p.transferDim.dicnt3 = a->i[11];
    p.transferDim.ddim1 = a->i[12]; p.transferDim.ddim2 = a->i[13]; p.transferDim.ddim3 = a->i[14];
    p.ioPointers.srcPtr = src;
    p.ioPointers.dstPtr = dst;
    int32_t blocks = DmaUtilsAutoInc3d_configure(HB_IDMA_CH1, &p);
    if (blocks < 0)
        return blocks;
    int triggers = 0;
    for (int32_t left = blocks; left > 0; triggers++) { /* trigger and wait per block */
        left = DmaUtilsAutoInc3d_trigger(HB_IDMA_CH1);
        if (left < 0) return left;
        if (DmaUtilsAutoInc3d_wait(HB_IDMA_CH1) != 0) return -5;
    }
    if (a->mode & 2) /* one trigger too many */
        return DmaUtilsAutoInc3d_trigger(HB_IDMA_CH1);
    DmaUtilsAutoInc3d_deconfigure(HB_IDMA_CH1);
    if (tile != NULL) {
        memcpy(output, tile, out_bytes);
        xvFreeBuffer(tm, tile);
    }
    return triggers;
}

/* 0x5005: printf, the logs, TIME_STAMP, XT_MIN/XT_MAX. */
static int op_print(void *input, void *output, void *tm) {
    (void)input; (void)tm;
    TIME_STAMP(t0);
    printf("printf %d %s %.2f|", 42, "text", 1.5);
    DSP_LOGI("info %d", XT_MIN(3, 7));
    DSP_LOGE("error %d\n", XT_MAX(3, 7));
    DSP_LOGD("debug %d", 1); /* compiled out at the default level */
    TIME_STAMP(t1);
    self_cycles = (int)(t1 - t0);
    ((uint64_t *)output)[0] = t1 - t0;
    ((uint64_t *)output)[1] = dspx_input_size();
    ((uint64_t *)output)[2] = dspx_output_size();
    return self_cycles > 0 ? 0 : 1;
}

/* 0x5006: busy for i[0] ms; output: start and end cycle stamps. */
static int op_busy(void *input, void *output, void *tm) {
    (void)tm;
    struct args *a = input;
    uint64_t *out = output, t0 = dspx_cycles();
    while (dspx_cycles() - t0 < (uint64_t)a->i[0] * 1000000u)
        ;
    out[0] = t0;
    out[1] = dspx_cycles();
    return 0;
}

static int op_segv(void *input, void *output, void *tm) {
    (void)input; (void)output; (void)tm;
    volatile uintptr_t bad = 8;
    *(volatile int *)bad = 1;
    return 0;
}

static int op_loop(void *input, void *output, void *tm) {
    (void)input; (void)output; (void)tm;
    for (volatile int spin = 1; spin;)
        ;
    return 0;
}

static int op_abort(void *input, void *output, void *tm) {
    (void)input; (void)output; (void)tm;
    abort();
}

static int op_nop(void *input, void *output, void *tm) {
    (void)input; (void)output; (void)tm;
    return 0;
}

/* 0x500b: returns i[0] after a failing mem_map when mode is 1. */
static int op_ret(void *input, void *output, void *tm) {
    (void)output; (void)tm;
    struct args *a = input;
    if (a->mode == 1)
        (void)hb_dsp_mem_map(0x10, 4);
    return a->i[0];
}

/* 0x500c: more bytes of printf than the ring holds. */
static int op_flood(void *input, void *output, void *tm) {
    (void)input; (void)output; (void)tm;
    for (int k = 0; k < 20000; k++)
        printf("line %05d\n", k);
    return 0;
}

/* 0x500d: queue a copy of [addr, addr+size) into the output, then compute
 * (poll the destination's last byte) without waiting; output after the
 * data: the cycle stamps of the copy's submission, of seeing its last byte
 * land, and of the IDMA_WAIT call. */
static int op_overlap(void *input, void *output, void *tm) {
    (void)tm;
    struct args *a = input;
    uint8_t *src = hb_dsp_mem_map(a->addr, a->size);
    if (src == MAP_FAILED)
        return HB_ERR_MMAP_FAILED;
    volatile uint8_t *dst = output;
    uint64_t *stamps = (uint64_t *)((uint8_t *)output + a->size);
    int32_t ret;
    stamps[0] = dspx_cycles();
    IDMA_COPY(HB_IDMA_CH0, ret, src, output, a->size)
    if (ret < 0) return ret;
    stamps[1] = 0;
    while (dspx_cycles() - stamps[0] < 2000000000u)
        if (dst[a->size - 1] == src[a->size - 1]) {
            stamps[1] = dspx_cycles();
            break;
        }
    stamps[2] = dspx_cycles();
    IDMA_WAIT(HB_IDMA_CH0, ret)
    return ret;
}

int dspx_ops_init(void) {
    int rc = 0;
    rc |= hb_dsp_register_fn(0x5001, op_map, 0);
    rc |= hb_dsp_register_fn(0x5002, op_tiles, 0);
    rc |= hb_dsp_register_fn(0x5003, op_dma, 0);
    rc |= hb_dsp_register_fn(0x5004, op_autoinc, 0);
    rc |= hb_dsp_register_fn(0x5005, op_print, 250);
    rc |= hb_dsp_register_fn(0x5006, op_busy, 0);
    rc |= hb_dsp_register_fn(0x5007, op_segv, 0);
    rc |= hb_dsp_register_fn(0x5008, op_loop, 0);
    rc |= hb_dsp_register_fn(0x5009, op_abort, 0);
    rc |= hb_dsp_register_fn(0x500a, op_nop, 0);
    rc |= hb_dsp_register_fn(0x500b, op_ret, 0);
    rc |= hb_dsp_register_fn(0x500c, op_flood, 0);
    rc |= hb_dsp_register_fn(0x500d, op_overlap, 0);
    return rc;
}
