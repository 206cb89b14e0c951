/*
 * The DSP runtime shim: the C side of dspx/dsp.h, loaded into every core
 * process (RTLD_GLOBAL, so native op libraries resolve against it).
 *
 * One context per simulated core holds its L2 (a buffer owned by Python),
 * the tile manager over L2's two halves, a two-channel DMA engine (one
 * pthread per channel, copies in order per channel) and the running task's
 * state: the connection's buffers (DSP address, size, host pointer), live
 * mem_maps, printf text and the first error an SDK call reported.  The
 * handler runs on the thread that called dspx_rt_run; SDK calls find the
 * context through a thread-local.
 *
 * Built with -DDSPX_COST=1 (the cost shim, dspx.sdk.runtime_shim(cost=True))
 * it also keeps the timing model's clock (dspx/cost.h): counted vector work
 * between synchronisation points, and a timeline per DMA channel.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "dspx/dsp.h"
#include "dspx_wire.h" /* the wire's status codes, generated from dspx.abi.protocol (dspx.sdk.gen_wire) */

#undef printf

#define MAX_REGIONS 256
#define MAX_MAPS 256
#define MAX_TILES 256
#define QCAP 64
#define TEXT_CAP (256 << 10)
#define DMA_TIMEOUT_S 10
/* With DSPX_TRACE set, each channel keeps its last TRACE_CAP transfers (start,
 * end, bytes) for the timeline (dspx.trace reads them after each task). */
#define TRACE_CAP 4096
/* A waiter whose copies are not done yet polls this long before sleeping: a
 * futex wake-up costs tens of microseconds, once per tile per frame.  (The
 * workers do not poll: their wake-up hides behind the tile being computed,
 * and on a busy host polling threads only steal the compute thread's CPU.) */
#define SPIN_NS 100000
#define DSPX_EXPORT __attribute__((visibility("default")))

struct region { uint64_t dsp, size; uint8_t *host; };
struct tile { size_t off, size; int bank; };

/* Up to four nested loops over bytes: cnt[0] bytes per row, dim[k] strides. */
struct pattern { uint8_t *base; int64_t cnt[4], dim[4]; };

struct job {
    const uint8_t *src;
    uint8_t *dst;
    size_t n;
    int strided;          /* an auto-increment block: n bytes from stream offset start */
    struct pattern sp, dp;
    uint64_t start;
    int tiles[2];         /* L2 offsets + 1 of the tiles touched, 0 = none */
    size_t tile_off[2];
};

struct autoinc { int configured; struct pattern sp, dp; uint64_t block, nblocks, next; size_t tile_off[2]; int tiles[2]; };

struct dma_rec { uint64_t t0, t1, bytes; };

struct channel {
    pthread_t thread;
    struct dma_rec *trace; /* NULL unless DSPX_TRACE is set */
    uint64_t ntrace;
    int64_t tid;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct job q[QCAP];
    uint64_t submitted, done, waited;
    int stop;
    struct autoinc ai;
};

/* A handler's tm is an opaque handle, not an address: a per-task value in
 * the non-canonical half of the address space (dereferencing it faults), that
 * the SDK calls compare with the running task's.  A forged or stale handle is
 * refused; nothing of the context is reachable through it. */
#define TM_TAG 0xD500000000000000ull
#define TM_MASK 0x00FFFFFFFFFFFFFFull

struct dspx_ctx {
    uint64_t canary_lo; /* canary_of(c): a write over the context's ends shows here */
    uint64_t tm_handle, tm_seed, tasks;
    uint8_t *l2;
    size_t l2_size;
    struct tile tiles[MAX_TILES]; /* sorted by offset */
    int ntiles;
    struct region regions[MAX_REGIONS];
    int nregions;
    struct { uint8_t *host; size_t size; } maps[MAX_MAPS];
    int nmaps;
    uint8_t *in, *out;
    size_t in_size, out_size;
    struct channel ch[DSPX_DMA_CHANNELS];
    char *text;
    size_t text_total;
    int fault;
    char broken[256]; /* what dspx_rt_check found wrong after the last task */
    uint64_t canary_hi;
};

static __thread struct dspx_ctx *cur;
static uint64_t canary_key; /* set once, outside every context */

static uint64_t canary_of(const struct dspx_ctx *c) { return canary_key ^ (uint64_t)(uintptr_t)c; }

static int tm_ok(const struct dspx_ctx *c, const void *tm) {
    return c != NULL && (uint64_t)(uintptr_t)tm == c->tm_handle;
}

/* ------------------------------------------------------------ text */

static void text_append(struct dspx_ctx *c, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        c->text[(c->text_total + i) % TEXT_CAP] = s[i];
    c->text_total += n;
}

static void vemit(const char *prefix, const char *fmt, va_list ap, int newline) {
    char small[1024];
    va_list aq;
    va_copy(aq, ap);
    int n = vsnprintf(small, sizeof small, fmt, aq);
    va_end(aq);
    if (n < 0)
        return;
    char *s = small;
    if ((size_t)n >= sizeof small) {
        s = malloc((size_t)n + 1);
        if (s == NULL)
            return;
        vsnprintf(s, (size_t)n + 1, fmt, ap);
    }
    int add_nl = newline && (n == 0 || s[n - 1] != '\n');
    if (cur != NULL) {
        text_append(cur, prefix, strlen(prefix));
        text_append(cur, s, (size_t)n);
        if (add_nl)
            text_append(cur, "\n", 1);
    } else { /* outside a task (e.g. in dspx_ops_init): the device log */
        fprintf(stderr, "%s%s%s", prefix, s, add_nl ? "\n" : "");
    }
    if (s != small)
        free(s);
}

/* Note an SDK error in the task's printf and remember the first status. */
__attribute__((format(printf, 2, 3))) static int fail(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vemit("[dspx] ", fmt, ap, 1);
    va_end(ap);
    if (cur != NULL && cur->fault == 0)
        cur->fault = status;
    return status;
}

DSPX_EXPORT int dspx_printf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vemit("", fmt, ap, 0);
    va_end(ap);
    return 0;
}

DSPX_EXPORT void dspx_log(int level, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vemit(level <= 0 ? "D: " : level == 1 ? "" : "E: ", fmt, ap, 1);
    va_end(ap);
}

/* The host's clock: what the runtime itself times (spins, the trace) with. */
static uint64_t wall_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#if DSPX_COST
/* ------------------------------------------------------------ the timing model (cost builds)
 * The rules are COST-SPEC's (and dspx.costmodel.clock's): the work counted
 * between two synchronisation points (a DMA issue or wait, a clock read, the
 * call's end) is a segment, costing its issue bound plus its stalls; a DMA
 * transfer starts when both the core has issued it and its channel is free;
 * a wait moves the clock to the channel's end.  One clock per thread (the
 * thread that runs the task); no modeled figure reads the host's clock. */

DSPX_EXPORT __thread struct dspx_cost_counters dspx_cost_tls;

struct cost_model {
    double rate[DSPX_COST_CLASSES], ls_rate, dma_rate;
    uint64_t ddr_load, ddr_store, tcm_load, dma_setup, overhead;
    int configured;
};
static struct cost_model model;

struct cost_clock {
    int on;
    uint64_t t, overhead, compute, ddr_stall, dma_wait;
    uint64_t chan_free[DSPX_DMA_CHANNELS], dma_bytes[DSPX_DMA_CHANNELS], dma_transfers[DSPX_DMA_CHANNELS];
    struct dspx_cost_counters seg; /* the counters when the open segment began */
};
static __thread struct cost_clock clk;

/* ceil(n / rate) for rate > 0, in doubles as Python's math.ceil(n / rate). */
static uint64_t ceil_div(uint64_t n, double rate) {
    double x = (double)n / rate;
    uint64_t q = (uint64_t)x;
    return q + ((double)q < x);
}

static int whole_cycles(double v, uint64_t *out) {
    if (!(v >= 0 && v < 9.0e15) || v != (double)(uint64_t)v)
        return -1;
    *out = (uint64_t)v;
    return 0;
}

DSPX_EXPORT int dspx_cost_configure(const struct dspx_cost_params *p) {
    double rates[] = {p->issue_alu, p->issue_mul, p->issue_special, p->issue_move, p->issue_load_store,
                      p->idma_bandwidth_bytes_per_cycle};
    for (size_t i = 0; i < sizeof rates / sizeof rates[0]; i++)
        if (!(rates[i] > 0))
            return -1;
    struct cost_model m = {.ls_rate = p->issue_load_store, .dma_rate = p->idma_bandwidth_bytes_per_cycle, .configured = 1};
    if ((p->ddr_cached != 0 && p->ddr_cached != 1) || whole_cycles(p->ddr_load_latency_cycles, &m.ddr_load) ||
        whole_cycles(p->ddr_store_cycles, &m.ddr_store) || whole_cycles(p->tcm_load_latency_cycles, &m.tcm_load) ||
        whole_cycles(p->idma_setup_cycles, &m.dma_setup) || whole_cycles(p->call_overhead_cycles, &m.overhead))
        return -1;
    if (p->ddr_cached != 0)
        m.ddr_load = 0; /* a cached DDR load costs its issue slot only */
    memcpy(m.rate, rates, sizeof m.rate);
    model = m;
    return 0;
}

DSPX_EXPORT void dspx_cost_begin(void) {
    uintptr_t lo = dspx_cost_tls.l2_lo, size = dspx_cost_tls.l2_size;
    memset(&clk, 0, sizeof clk);
    memset(&dspx_cost_tls, 0, sizeof dspx_cost_tls);
    dspx_cost_tls.l2_lo = lo;
    dspx_cost_tls.l2_size = size;
    clk.on = model.configured;
    clk.t = clk.overhead = model.overhead;
    clk.seg = dspx_cost_tls;
}

static void cost_set_l2(const uint8_t *lo, size_t size) {
    dspx_cost_tls.l2_lo = (uintptr_t)lo;
    dspx_cost_tls.l2_size = size;
}

/* Book the open segment: its issue bound as compute, its stalls as ddr_stall. */
static void cost_segment(void) {
    if (!clk.on)
        return;
    const struct dspx_cost_counters *n = &dspx_cost_tls, *s = &clk.seg;
    uint64_t ddr_ld = n->ddr_loads - s->ddr_loads, ddr_st = n->ddr_stores - s->ddr_stores;
    uint64_t tcm_ld = n->tcm_loads - s->tcm_loads, tcm_st = n->tcm_stores - s->tcm_stores;
    uint64_t issue = ceil_div(ddr_ld + ddr_st + tcm_ld + tcm_st, model.ls_rate);
    for (int k = 0; k < DSPX_COST_CLASSES; k++) {
        uint64_t cyc = ceil_div(n->ops[k] - s->ops[k], model.rate[k]);
        issue = cyc > issue ? cyc : issue;
    }
    uint64_t stall = ddr_ld * model.ddr_load + ddr_st * model.ddr_store + tcm_ld * model.tcm_load;
    clk.compute += issue;
    clk.ddr_stall += stall;
    clk.t += issue + stall;
    clk.seg = *n;
}

static void cost_dma_issue(int ch, uint64_t bytes) {
    if (!clk.on)
        return;
    cost_segment();
    uint64_t start = clk.t > clk.chan_free[ch] ? clk.t : clk.chan_free[ch];
    clk.chan_free[ch] = start + model.dma_setup + ceil_div(bytes, model.dma_rate);
    clk.dma_bytes[ch] += bytes;
    clk.dma_transfers[ch]++;
}

static void cost_dma_wait(int ch) {
    if (!clk.on)
        return;
    cost_segment();
    if (clk.chan_free[ch] > clk.t) {
        clk.dma_wait += clk.chan_free[ch] - clk.t;
        clk.t = clk.chan_free[ch];
    }
}

DSPX_EXPORT void dspx_cost_end(struct dspx_cost_record *r) {
    for (int k = 0; k < DSPX_DMA_CHANNELS; k++) /* transfers still running are waited for */
        cost_dma_wait(k);
    cost_segment();
    const struct dspx_cost_counters *n = &dspx_cost_tls;
    *r = (struct dspx_cost_record){
        .cycles = clk.t, .overhead = clk.overhead, .compute = clk.compute, .ddr_stall = clk.ddr_stall,
        .dma_wait = clk.dma_wait, .ddr_loads = n->ddr_loads, .ddr_stores = n->ddr_stores,
        .tcm_loads = n->tcm_loads, .tcm_stores = n->tcm_stores, .ops_alu = n->ops[DSPX_COST_ALU],
        .ops_mul = n->ops[DSPX_COST_MUL], .ops_special = n->ops[DSPX_COST_SPECIAL], .ops_move = n->ops[DSPX_COST_MOVE]};
    memcpy(r->dma_bytes, clk.dma_bytes, sizeof r->dma_bytes);
    memcpy(r->dma_transfers, clk.dma_transfers, sizeof r->dma_transfers);
    clk.on = 0;
}

/* The sizes of the two structs, for the host's ctypes mirror to check. */
DSPX_EXPORT uint32_t dspx_cost_abi(void) {
    return (uint32_t)(sizeof(struct dspx_cost_params) | sizeof(struct dspx_cost_record) << 16);
}

/* A clock read is a synchronisation point: the modeled clock while a call is
 * counted, the host's otherwise. */
DSPX_EXPORT uint64_t dspx_cycles(void) {
    if (!clk.on)
        return wall_ns();
    cost_segment();
    return clk.t;
}
#else
#define cost_dma_issue(ch, bytes) ((void)0)
#define cost_dma_wait(ch) ((void)0)
#define cost_set_l2(lo, size) ((void)0)
DSPX_EXPORT uint64_t dspx_cycles(void) { return wall_ns(); }
#endif

DSPX_EXPORT size_t dspx_input_size(void) { return cur ? cur->in_size : 0; }
DSPX_EXPORT size_t dspx_output_size(void) { return cur ? cur->out_size : 0; }

/* ------------------------------------------------------------ registration */

#define MAX_REGS 256
static struct { int cmd, latency; handle_fn fn; } regs[MAX_REGS];
static int nregs, collecting;
static char collect_error[256];

DSPX_EXPORT int hb_dsp_register_fn(int cmd, handle_fn handle, int latency) {
    if (!collecting)
        return fail(DSPX_STATUS_ERR_INVALID, "RuntimeMisuse: hb_dsp_register_fn(0x%x) outside dspx_ops_init", (unsigned)cmd);
    const char *why = cmd < 0 ? "a negative command id" : handle == NULL ? "a NULL handler"
                      : latency < 0 ? "a negative latency" : nregs == MAX_REGS ? "too many operators" : NULL;
    if (why != NULL) {
        if (!collect_error[0])
            snprintf(collect_error, sizeof collect_error, "hb_dsp_register_fn(0x%x): %s", (unsigned)cmd, why);
        return DSPX_STATUS_ERR_INVALID;
    }
    regs[nregs].cmd = cmd;
    regs[nregs].fn = handle;
    regs[nregs].latency = latency;
    nregs++;
    return 0;
}

DSPX_EXPORT void dspx_rt_collect_begin(void) {
    nregs = 0;
    collect_error[0] = 0;
    collecting = 1;
}

/* The registrations since begin: their count, or -1 with the error text in err. */
DSPX_EXPORT int dspx_rt_collect_end(int max, int *cmds, void **fns, int *lats, char *err, int errcap) {
    collecting = 0;
    if (collect_error[0]) {
        snprintf(err, (size_t)errcap, "%s", collect_error);
        return -1;
    }
    for (int i = 0; i < nregs && i < max; i++) {
        cmds[i] = regs[i].cmd;
        fns[i] = (void *)regs[i].fn;
        lats[i] = regs[i].latency;
    }
    return nregs;
}

/* The exported name of a handler, when it has one ("" otherwise); returns
 * its offset in its library (for names only the symbol table knows). */
DSPX_EXPORT uint64_t dspx_rt_symbol_name(void *fn, char *buf, int cap) {
    Dl_info info;
    buf[0] = 0;
    if (!dladdr(fn, &info))
        return 0;
    if (info.dli_sname != NULL && info.dli_saddr == fn)
        snprintf(buf, (size_t)cap, "%s", info.dli_sname);
    return (uint64_t)((uintptr_t)fn - (uintptr_t)info.dli_fbase);
}

/* ------------------------------------------------------------ memory */

static int inside(const uint8_t *p, size_t n, const uint8_t *lo, size_t size) {
    return p >= lo && n <= size && (size_t)(p - lo) <= size - n;
}

DSPX_EXPORT void *hb_dsp_mem_map(uint64_t dsp_addr, uint32_t size) {
    struct dspx_ctx *c = cur;
    if (c == NULL) {
        fail(DSPX_STATUS_ERR_INVALID, "RuntimeMisuse: hb_dsp_mem_map called outside a task");
        return MAP_FAILED;
    }
    for (int i = 0; i < c->nregions; i++) {
        struct region *r = &c->regions[i];
        if (dsp_addr >= r->dsp && size <= r->size && dsp_addr - r->dsp <= r->size - size) {
            if (c->nmaps == MAX_MAPS) {
                fail(DSPX_STATUS_ERR_INVALID, "RuntimeMisuse: hb_dsp_mem_map: %d mappings already live", MAX_MAPS);
                return MAP_FAILED;
            }
            uint8_t *p = r->host + (dsp_addr - r->dsp);
            c->maps[c->nmaps].host = p;
            c->maps[c->nmaps].size = size;
            c->nmaps++;
            return p;
        }
    }
    fail(DSPX_STATUS_ERR_ADDR, "MapError: mem_map(0x%llx, %u): range 0x%llx+%u is not inside any buffer of this connection",
         (unsigned long long)dsp_addr, size, (unsigned long long)dsp_addr, size);
    return MAP_FAILED;
}

DSPX_EXPORT int hb_dsp_mem_unmap(uint64_t addr) {
    struct dspx_ctx *c = cur;
    if (c == NULL)
        return fail(DSPX_STATUS_ERR_INVALID, "RuntimeMisuse: hb_dsp_mem_unmap called outside a task");
    for (int i = c->nmaps - 1; i >= 0; i--) {
        uint64_t p = (uint64_t)(uintptr_t)c->maps[i].host;
        if (p == addr || (addr <= UINT32_MAX && (uint32_t)p == (uint32_t)addr)) {
            c->maps[i] = c->maps[--c->nmaps];
            return 0;
        }
    }
    return fail(DSPX_STATUS_ERR_INVALID, "RuntimeMisuse: hb_dsp_mem_unmap(0x%llx): not a pointer hb_dsp_mem_map returned "
                "(or already unmapped)", (unsigned long long)addr);
}

/* Over-reads of the emulated aligning loads: only bytes inside L2 or a task
 * buffer are read; the rest of the vector is 0.  Memory the runtime does not
 * know (the caller's own) is read as is. */
DSPX_EXPORT void dspx_ivp_guarded_load(const void *vp, void *out, int nbytes) {
    const uint8_t *p = vp;
    struct dspx_ctx *c = cur;
    size_t n = (size_t)nbytes;
    if (c != NULL) {
        int near_end = 0;
        for (int i = -1; i < c->nregions; i++) {
            const uint8_t *lo = i < 0 ? c->l2 : c->regions[i].host;
            size_t size = i < 0 ? c->l2_size : (size_t)c->regions[i].size;
            if (p >= lo && (size_t)(p - lo) < size) {
                size_t k = size - (size_t)(p - lo);
                k = k < n ? k : n;
                memset(out, 0, n);
                memcpy(out, p, k);
                return;
            }
            if (p >= lo + size && (size_t)(p - (lo + size)) < n)
                near_end = 1;
        }
        if (near_end) { /* just past the end of a buffer: nothing of it to read */
            memset(out, 0, n);
            return;
        }
    }
    memcpy(out, p, n);
}

/* ------------------------------------------------------------ L2 tiles */

static size_t bank_lo(struct dspx_ctx *c, int b) { return b == 0 ? 0 : c->l2_size / 2; }
static size_t bank_hi(struct dspx_ctx *c, int b) { return b == 0 ? c->l2_size / 2 : c->l2_size; }

static int tile_index(struct dspx_ctx *c, const uint8_t *p) {
    for (int i = 0; i < c->ntiles; i++)
        if (c->l2 + c->tiles[i].off == p)
            return i;
    return -1;
}

DSPX_EXPORT void *xvAllocateBuffer(xvTileManager *tm, int32_t size, int32_t color, int32_t align) {
    struct dspx_ctx *c = cur;
    if (!tm_ok(c, tm)) {
        fail(DSPX_STATUS_ERR_INVALID, "RuntimeMisuse: xvAllocateBuffer: tm %p is not the running task's tile manager "
             "(pass the handler's tm unchanged, during that task)", (void *)tm);
        return NULL;
    }
    if (size <= 0 || (color != 0 && color != 1) || align <= 0 || (align & (align - 1))) {
        fail(DSPX_STATUS_ERR_INVALID, "RuntimeMisuse: xvAllocateBuffer(size %d, bank %d, align %d): size must be > 0, "
             "bank 0 or 1, align a power of two", size, color, align);
        return NULL;
    }
    if (c->ntiles == MAX_TILES) {
        fail(DSPX_STATUS_ERR_NOMEM, "TileExhausted: %d tiles already live", MAX_TILES);
        return NULL;
    }
    uintptr_t base = (uintptr_t)c->l2, a = (uintptr_t)align;
    size_t lo = bank_lo(c, color), hi = bank_hi(c, color), free_bytes = 0, largest = 0, prev = lo;
    for (int i = 0; i <= c->ntiles; i++) { /* first fit over the holes between the bank's tiles */
        if (i < c->ntiles && c->tiles[i].off < lo)
            continue;
        size_t hole_end = i == c->ntiles || c->tiles[i].off >= hi ? hi : c->tiles[i].off;
        size_t start = (size_t)(((base + prev + a - 1) & ~(a - 1)) - base);
        if (start + (size_t)size <= hole_end) {
            memmove(&c->tiles[i + 1], &c->tiles[i], (size_t)(c->ntiles - i) * sizeof c->tiles[0]);
            c->tiles[i].off = start;
            c->tiles[i].size = (size_t)size;
            c->tiles[i].bank = color;
            c->ntiles++;
            return c->l2 + start;
        }
        free_bytes += hole_end - prev;
        largest = hole_end - prev > largest ? hole_end - prev : largest;
        if (hole_end == hi)
            break;
        prev = c->tiles[i].off + c->tiles[i].size;
    }
    fail(DSPX_STATUS_ERR_NOMEM, "TileExhausted: L2 bank %d: cannot allocate a %d-byte tile (free %zu of %zu bytes, "
         "largest hole %zu)", color, size, free_bytes, hi - lo, largest);
    return NULL;
}

static int32_t wait_channel(struct dspx_ctx *c, int32_t chn);

/* Copies queued on channel k, not yet waited for, that touch the tile at off. */
static int pinned(struct dspx_ctx *c, int k, size_t off) {
    int n = 0;
    struct channel *ch = &c->ch[k];
    pthread_mutex_lock(&ch->mu);
    for (uint64_t j = ch->waited; j < ch->submitted; j++) {
        struct job *jb = &ch->q[j % QCAP];
        for (int t = 0; t < 2; t++)
            n += jb->tiles[t] && jb->tile_off[t] == off;
    }
    pthread_mutex_unlock(&ch->mu);
    return n;
}

/* A tile with copies in flight is freed once they are done: the seed frees
 * its tiles right after its last frame, which waits on one channel only. */
DSPX_EXPORT int32_t xvFreeBuffer(xvTileManager *tm, void const *buf) {
    struct dspx_ctx *c = cur;
    if (!tm_ok(c, tm)) {
        fail(DSPX_STATUS_ERR_INVALID, "RuntimeMisuse: xvFreeBuffer: tm %p is not the running task's tile manager "
             "(pass the handler's tm unchanged, during that task)", (void *)tm);
        return XVTM_ERROR;
    }
    int i = tile_index(c, buf);
    if (i < 0) {
        fail(DSPX_STATUS_ERR_INVALID, "RuntimeMisuse: xvFreeBuffer(%p): not a live tile (double free, or not from "
             "xvAllocateBuffer)", buf);
        return XVTM_ERROR;
    }
    for (int k = 0; k < DSPX_DMA_CHANNELS; k++) {
        if (!pinned(c, k, c->tiles[i].off))
            continue;
        cost_dma_wait(k);
        if (wait_channel(c, k) != 0)
            return XVTM_ERROR;
    }
    memmove(&c->tiles[i], &c->tiles[i + 1], (size_t)(c->ntiles - i - 1) * sizeof c->tiles[0]);
    c->ntiles--;
    return XVTM_SUCCESS;
}

/* ------------------------------------------------------------ DMA */

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_ACQUIRE)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELEASE)

/* Where [p, p+n) may be copied: a live tile (its offset in *tile), a task
 * buffer, or the task's input/output.  0 if allowed. */
static int dma_range_ok(struct dspx_ctx *c, const uint8_t *p, size_t n, int *tile, size_t *tile_off,
                        const char *what) {
    *tile = 0;
    if (p >= c->l2 && p < c->l2 + c->l2_size) {
        for (int i = 0; i < c->ntiles; i++)
            if (inside(p, n, c->l2 + c->tiles[i].off, c->tiles[i].size)) {
                *tile = 1;
                *tile_off = c->tiles[i].off;
                return 0;
            }
        return fail(DSPX_STATUS_ERR_INVALID, "DmaError: DMA %s L2+0x%zx (+%zu) is not inside a live tile (freed, or never "
                    "allocated)", what, (size_t)(p - c->l2), n);
    }
    for (int i = 0; i < c->nregions; i++)
        if (inside(p, n, c->regions[i].host, (size_t)c->regions[i].size))
            return 0;
    if (inside(p, n, c->in, c->in_size) || inside(p, n, c->out, c->out_size))
        return 0;
    return fail(DSPX_STATUS_ERR_INVALID, "DmaError: DMA %s %p (+%zu) is not inside the task's buffers or a live L2 tile",
                what, (const void *)p, n);
}

static int channel_ok(struct dspx_ctx *c, int32_t ch, const char *api) {
    if (c == NULL)
        return fail(DSPX_STATUS_ERR_INVALID, "RuntimeMisuse: %s called outside a task", api);
    if (ch < 0 || ch >= DSPX_DMA_CHANNELS)
        return fail(DSPX_STATUS_ERR_INVALID, "DmaError: %s: DMA channel %d does not exist (channels 0..%d)", api, ch,
                    DSPX_DMA_CHANNELS - 1);
    return 0;
}

static int32_t submit(struct dspx_ctx *c, int32_t chn, const struct job *jb) {
    struct channel *ch = &c->ch[chn];
    pthread_mutex_lock(&ch->mu);
    if (ch->submitted - ch->waited >= QCAP) {
        pthread_mutex_unlock(&ch->mu);
        return fail(DSPX_STATUS_ERR_INVALID, "DmaError: DMA channel %d has %d copies not waited for (the most it queues)",
                    chn, QCAP);
    }
    uint64_t ticket = ch->submitted;
    ch->q[ticket % QCAP] = *jb;
    STORE(ch->submitted, ticket + 1);
    pthread_cond_broadcast(&ch->cv);
    pthread_mutex_unlock(&ch->mu);
    return (int32_t)(ticket & 0x7fffffff);
}

DSPX_EXPORT int32_t dspx_idma_copy(int32_t chn, const void *src, void *dst, int32_t nbytes) {
    struct dspx_ctx *c = cur;
    int bad = channel_ok(c, chn, "IDMA_COPY");
    if (bad)
        return bad;
    if (nbytes <= 0)
        return fail(DSPX_STATUS_ERR_INVALID, "DmaError: IDMA_COPY of %d bytes (must be > 0)", nbytes);
    struct job jb;
    memset(&jb, 0, sizeof jb);
    jb.src = src;
    jb.dst = dst;
    jb.n = (size_t)nbytes;
    if (dma_range_ok(c, jb.src, jb.n, &jb.tiles[0], &jb.tile_off[0], "source") ||
        dma_range_ok(c, jb.dst, jb.n, &jb.tiles[1], &jb.tile_off[1], "destination"))
        return c->fault;
    int32_t t = submit(c, chn, &jb);
    if (t >= 0)
        cost_dma_issue(chn, jb.n);
    return t;
}

static int32_t wait_channel(struct dspx_ctx *c, int32_t chn) {
    struct channel *ch = &c->ch[chn];
    uint64_t target = LOAD(ch->submitted);
    if (LOAD(ch->done) != target) {
        uint64_t t0 = wall_ns();
        while (LOAD(ch->done) != target && wall_ns() - t0 < SPIN_NS)
            __builtin_ia32_pause();
    }
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += DMA_TIMEOUT_S;
    pthread_mutex_lock(&ch->mu);
    int rc = 0;
    while (ch->done < ch->submitted && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&ch->cv, &ch->mu, &dl);
    uint64_t left = ch->submitted - ch->done;
    if (!left)
        ch->waited = ch->submitted;
    pthread_mutex_unlock(&ch->mu);
    if (left)
        return fail(DSPX_STATUS_ERR_TIMEOUT, "DmaTimeout: DMA channel %d: %llu copies not complete after %d s", chn,
                    (unsigned long long)left, DMA_TIMEOUT_S);
    return 0;
}

DSPX_EXPORT int32_t dspx_idma_wait(int32_t chn) {
    int bad = channel_ok(cur, chn, "IDMA_WAIT");
    if (bad)
        return bad;
    cost_dma_wait(chn);
    return wait_channel(cur, chn);
}

/* The stream offset `start` of a pattern as loop indices. */
static void pattern_seek(const struct pattern *pt, uint64_t start, int64_t idx[4]) {
    for (int k = 0; k < 4; k++) {
        idx[k] = (int64_t)(start % (uint64_t)pt->cnt[k]);
        start /= (uint64_t)pt->cnt[k];
    }
}

static uint8_t *pattern_addr(const struct pattern *pt, const int64_t idx[4]) {
    return pt->base + idx[0] + idx[1] * pt->dim[1] + idx[2] * pt->dim[2] + idx[3] * pt->dim[3];
}

static void pattern_step(const struct pattern *pt, int64_t idx[4], int64_t n) {
    idx[0] += n;
    for (int k = 0; k < 3 && idx[k] == pt->cnt[k]; k++) {
        idx[k] = 0;
        idx[k + 1]++;
    }
}

static void run_strided(const struct job *jb) {
    int64_t si[4], di[4];
    pattern_seek(&jb->sp, jb->start, si);
    pattern_seek(&jb->dp, jb->start, di);
    for (uint64_t left = jb->n; left;) {
        int64_t n = jb->sp.cnt[0] - si[0];
        if (jb->dp.cnt[0] - di[0] < n)
            n = jb->dp.cnt[0] - di[0];
        if ((int64_t)left < n)
            n = (int64_t)left;
        memcpy(pattern_addr(&jb->dp, di), pattern_addr(&jb->sp, si), (size_t)n);
        pattern_step(&jb->sp, si, n);
        pattern_step(&jb->dp, di, n);
        left -= (uint64_t)n;
    }
}

static void *dma_worker(void *arg) {
    struct channel *ch = arg;
    ch->tid = (int64_t)syscall(SYS_gettid);
    for (;;) {
        pthread_mutex_lock(&ch->mu);
        while (ch->done == ch->submitted && !ch->stop)
            pthread_cond_wait(&ch->cv, &ch->mu);
        pthread_mutex_unlock(&ch->mu);
        uint64_t next = LOAD(ch->done);
        if (next == LOAD(ch->submitted)) {
            if (LOAD(ch->stop))
                return NULL;
            continue;
        }
        struct job jb = ch->q[next % QCAP]; /* written before submitted was released */
        uint64_t t0 = ch->trace ? wall_ns() : 0;
        if (jb.strided)
            run_strided(&jb);
        else
            memcpy(jb.dst, jb.src, jb.n);
        if (ch->trace) {
            struct dma_rec *r = &ch->trace[ch->ntrace++ % TRACE_CAP];
            r->t0 = t0;
            r->t1 = wall_ns();
            r->bytes = jb.n;
        }
        pthread_mutex_lock(&ch->mu);
        STORE(ch->done, next + 1);
        pthread_cond_broadcast(&ch->cv);
        pthread_mutex_unlock(&ch->mu);
    }
}

/* ------------------------------------------------------------ C7x-style auto-increment */

static int pattern_from(struct pattern *pt, uint8_t *base, const int32_t cnt[4], const int32_t dim[3]) {
    pt->base = base;
    pt->dim[0] = 1;
    for (int k = 0; k < 4; k++) {
        if (cnt[k] < 1)
            return -1;
        pt->cnt[k] = cnt[k];
        if (k)
            pt->dim[k] = dim[k - 1];
    }
    return 0;
}

static int pattern_range_ok(struct dspx_ctx *c, const struct pattern *pt, int *tile, size_t *off,
                            const char *what) {
    /* 128-bit: three spans of up to 2^62 bytes each overflow 64 bits */
    __int128 lo = 0, hi = pt->cnt[0];
    for (int k = 1; k < 4; k++) {
        __int128 span = (__int128)(pt->cnt[k] - 1) * pt->dim[k];
        if (span < 0)
            lo += span;
        else
            hi += span;
    }
    if (pt->base == NULL)
        return fail(DSPX_STATUS_ERR_INVALID, "DmaError: DmaUtilsAutoInc3d_configure: NULL %s pointer", what);
    if (-lo > (__int128)(uintptr_t)pt->base || hi - lo > (__int128)SIZE_MAX)
        return fail(DSPX_STATUS_ERR_INVALID, "DmaError: DMA %s %p: the pattern spans more than the address space",
                    what, (const void *)pt->base);
    return dma_range_ok(c, pt->base - (size_t)-lo, (size_t)(hi - lo), tile, off, what);
}

DSPX_EXPORT int32_t DmaUtilsAutoInc3d_configure(int32_t chn, const DmaUtilsAutoInc3d_TransferProp *prop) {
    struct dspx_ctx *c = cur;
    int bad = channel_ok(c, chn, "DmaUtilsAutoInc3d_configure");
    if (bad)
        return bad;
    struct autoinc *ai = &c->ch[chn].ai;
    const DmaUtilsAutoInc3d_TransferDim *d = &prop->transferDim;
    int32_t sc[4] = {d->sicnt0, d->sicnt1, d->sicnt2, d->sicnt3}, sd[3] = {d->sdim1, d->sdim2, d->sdim3};
    int32_t dc[4] = {d->dicnt0, d->dicnt1, d->dicnt2, d->dicnt3}, dd[3] = {d->ddim1, d->ddim2, d->ddim3};
    struct autoinc next;
    memset(&next, 0, sizeof next);
    if (prop->syncType < DMAUTILSAUTOINC3D_SYNC_1D || prop->syncType > DMAUTILSAUTOINC3D_SYNC_4D)
        return fail(DSPX_STATUS_ERR_INVALID, "DmaError: DmaUtilsAutoInc3d_configure: syncType %d (0..3)", prop->syncType);
    if (pattern_from(&next.sp, prop->ioPointers.srcPtr, sc, sd) ||
        pattern_from(&next.dp, prop->ioPointers.dstPtr, dc, dd))
        return fail(DSPX_STATUS_ERR_INVALID, "DmaError: DmaUtilsAutoInc3d_configure: every icnt must be >= 1");
    uint64_t sblock = 1, dblock = 1, stotal = 1, dtotal = 1;
    for (int k = 0; k < 4; k++) {
        if (k <= prop->syncType) {
            sblock *= (uint64_t)sc[k];
            dblock *= (uint64_t)dc[k];
        }
        stotal *= (uint64_t)sc[k];
        dtotal *= (uint64_t)dc[k];
    }
    if (stotal != dtotal || sblock != dblock)
        return fail(DSPX_STATUS_ERR_INVALID, "DmaError: DmaUtilsAutoInc3d_configure: source moves %llu bytes (%llu per block), "
                    "destination %llu (%llu per block)", (unsigned long long)stotal, (unsigned long long)sblock,
                    (unsigned long long)dtotal, (unsigned long long)dblock);
    if (pattern_range_ok(c, &next.sp, &next.tiles[0], &next.tile_off[0], "source") ||
        pattern_range_ok(c, &next.dp, &next.tiles[1], &next.tile_off[1], "destination"))
        return c->fault;
    next.configured = 1;
    next.block = sblock;
    next.nblocks = stotal / sblock;
    *ai = next;
    return (int32_t)next.nblocks;
}

DSPX_EXPORT int32_t DmaUtilsAutoInc3d_trigger(int32_t chn) {
    struct dspx_ctx *c = cur;
    int bad = channel_ok(c, chn, "DmaUtilsAutoInc3d_trigger");
    if (bad)
        return bad;
    struct autoinc *ai = &c->ch[chn].ai;
    if (!ai->configured)
        return fail(DSPX_STATUS_ERR_INVALID, "DmaError: DmaUtilsAutoInc3d_trigger: nothing configured on channel %d", chn);
    if (ai->next == ai->nblocks)
        return fail(DSPX_STATUS_ERR_INVALID, "DmaError: DmaUtilsAutoInc3d_trigger: all %llu blocks of channel %d already "
                    "triggered", (unsigned long long)ai->nblocks, chn);
    struct job jb;
    memset(&jb, 0, sizeof jb);
    jb.strided = 1;
    jb.sp = ai->sp;
    jb.dp = ai->dp;
    jb.start = ai->next * ai->block;
    jb.n = ai->block;
    memcpy(jb.tiles, ai->tiles, sizeof jb.tiles);
    memcpy(jb.tile_off, ai->tile_off, sizeof jb.tile_off);
    int32_t t = submit(c, chn, &jb);
    if (t < 0)
        return t;
    cost_dma_issue(chn, jb.n);
    ai->next++;
    return (int32_t)(ai->nblocks - ai->next);
}

DSPX_EXPORT int32_t DmaUtilsAutoInc3d_wait(int32_t chn) { return dspx_idma_wait(chn); }

DSPX_EXPORT int32_t DmaUtilsAutoInc3d_deconfigure(int32_t chn) {
    int32_t rc = dspx_idma_wait(chn);
    if (rc == 0)
        memset(&cur->ch[chn].ai, 0, sizeof cur->ch[chn].ai);
    return rc;
}

/* ------------------------------------------------------------ the context, for Python */

DSPX_EXPORT struct dspx_ctx *dspx_rt_new(void *l2, size_t l2_size) {
    struct dspx_ctx *c = calloc(1, sizeof *c);
    if (c == NULL)
        return NULL;
    c->text = malloc(TEXT_CAP);
    if (c->text == NULL) {
        free(c);
        return NULL;
    }
    if (canary_key == 0) {
        if (syscall(SYS_getrandom, &canary_key, sizeof canary_key, 0) != (long)sizeof canary_key)
            canary_key = wall_ns();
        canary_key |= 1;
    }
    if (syscall(SYS_getrandom, &c->tm_seed, sizeof c->tm_seed, 0) != (long)sizeof c->tm_seed)
        c->tm_seed = wall_ns() * 0x9E3779B97F4A7C15ull;
    c->canary_lo = c->canary_hi = canary_of(c);
    c->l2 = l2;
    c->l2_size = l2_size;
    for (int k = 0; k < DSPX_DMA_CHANNELS; k++) {
        struct channel *ch = &c->ch[k];
        pthread_mutex_init(&ch->mu, NULL);
        pthread_cond_init(&ch->cv, NULL);
        if (getenv("DSPX_TRACE") != NULL)
            ch->trace = calloc(TRACE_CAP, sizeof *ch->trace);
        if (pthread_create(&ch->thread, NULL, dma_worker, ch) != 0) {
            for (int j = 0; j < k; j++) {
                pthread_mutex_lock(&c->ch[j].mu);
                c->ch[j].stop = 1;
                pthread_cond_broadcast(&c->ch[j].cv);
                pthread_mutex_unlock(&c->ch[j].mu);
                pthread_join(c->ch[j].thread, NULL);
            }
            free(c->text);
            free(c);
            return NULL;
        }
    }
    return c;
}

/* The transfers channel chn recorded since the last call (DSPX_TRACE), as
 * (start ns, end ns, bytes) triples into out; *tid is the channel's thread. */
DSPX_EXPORT size_t dspx_rt_take_dma(struct dspx_ctx *c, int32_t chn, uint64_t *out, size_t cap, int64_t *tid) {
    if (chn < 0 || chn >= DSPX_DMA_CHANNELS)
        return 0;
    struct channel *ch = &c->ch[chn];
    *tid = ch->tid;
    if (ch->trace == NULL)
        return 0;
    uint64_t n = LOAD(ch->ntrace), i = n > TRACE_CAP ? n - TRACE_CAP : 0;
    size_t k = 0;
    for (; i < n && k < cap; i++, k++) {
        const struct dma_rec *r = &ch->trace[i % TRACE_CAP];
        out[3 * k] = r->t0;
        out[3 * k + 1] = r->t1;
        out[3 * k + 2] = r->bytes;
    }
    STORE(ch->ntrace, 0);
    return k;
}

DSPX_EXPORT void dspx_rt_free(struct dspx_ctx *c) {
    for (int k = 0; k < DSPX_DMA_CHANNELS; k++) {
        struct channel *ch = &c->ch[k];
        pthread_mutex_lock(&ch->mu);
        STORE(ch->stop, 1);
        pthread_cond_broadcast(&ch->cv);
        pthread_mutex_unlock(&ch->mu);
        pthread_join(ch->thread, NULL);
        free(ch->trace);
    }
    free(c->text);
    free(c);
}

/* The connection's buffers for the next task: n triples (dsp addr, size, host ptr). */
DSPX_EXPORT int dspx_rt_set_regions(struct dspx_ctx *c, int n, const uint64_t *triples) {
    if (n < 0 || n > MAX_REGIONS)
        return DSPX_STATUS_ERR_INVALID;
    for (int i = 0; i < n; i++) {
        c->regions[i].dsp = triples[3 * i];
        c->regions[i].size = triples[3 * i + 1];
        c->regions[i].host = (uint8_t *)(uintptr_t)triples[3 * i + 2];
    }
    c->nregions = n;
    return 0;
}

/* Return the core to idle: wait for copies left in flight, free tiles left
 * allocated, forget the task's maps and auto-increment transfers. */
static void settle(struct dspx_ctx *c) {
    uint64_t left = 0;
    for (int k = 0; k < DSPX_DMA_CHANNELS; k++) {
        pthread_mutex_lock(&c->ch[k].mu);
        left += c->ch[k].submitted - c->ch[k].waited;
        pthread_mutex_unlock(&c->ch[k].mu);
        wait_channel(c, k);
        memset(&c->ch[k].ai, 0, sizeof c->ch[k].ai);
    }
    if (left)
        fail(0, "handler returned with %llu DMA copies not waited for", (unsigned long long)left);
    if (c->ntiles)
        fail(0, "handler returned with %d L2 tiles allocated; freed", c->ntiles);
    c->ntiles = 0;
    c->nmaps = 0;
}

#define BROKEN(...) (snprintf(c->broken, sizeof c->broken, __VA_ARGS__), -1)

/* The runtime's own state, checked after user code ran (cheap: a few loads
 * and a tryjoin per channel): 0 if intact, else -1 with what is broken in
 * c->broken (dspx_rt_broken).  settled: the task's copies were all waited
 * for and its tiles freed, so every queue must be empty. */
DSPX_EXPORT int dspx_rt_check(struct dspx_ctx *c, int settled) {
    c->broken[0] = 0;
    if (c->canary_lo != canary_of(c) || c->canary_hi != canary_of(c)) {
        uint64_t want = canary_of(c), lo = c->canary_lo, hi = c->canary_hi;
        return BROKEN("the canary %s the runtime context was overwritten (memory around the tile manager "
                      "was written)", lo != want && hi != want ? "on both sides of" : lo != want ? "before" : "after");
    }
    for (int k = 0; k < DSPX_DMA_CHANNELS; k++) {
        struct channel *ch = &c->ch[k];
        uint64_t s = LOAD(ch->submitted), d = LOAD(ch->done), w = ch->waited;
        if (LOAD(ch->stop))
            return BROKEN("DMA channel %d's stop flag was set (its thread ends)", k);
        if (pthread_tryjoin_np(ch->thread, NULL) != EBUSY)
            return BROKEN("DMA channel %d's thread is gone", k);
        if (d > s || w > s || s - w > QCAP || (settled && (d != s || w != s)))
            return BROKEN("DMA channel %d's queue is inconsistent (submitted %llu, done %llu, waited %llu)", k,
                          (unsigned long long)s, (unsigned long long)d, (unsigned long long)w);
    }
    if (c->ntiles < 0 || c->ntiles > MAX_TILES || c->nmaps < 0 || c->nmaps > MAX_MAPS || c->nregions < 0 ||
        c->nregions > MAX_REGIONS || (settled && (c->ntiles || c->nmaps)))
        return BROKEN("the tile/map tables are inconsistent (%d tiles, %d maps, %d regions)", c->ntiles, c->nmaps,
                      c->nregions);
    return 0;
}

/* What dspx_rt_check found broken ("" if nothing). */
DSPX_EXPORT const char *dspx_rt_broken(struct dspx_ctx *c) { return c->broken; }

/* Run one task: *rv the handler's return, *elapsed its cycles; returns the
 * status of the first SDK error noted during it (0 if none). */
DSPX_EXPORT int dspx_rt_run(struct dspx_ctx *c, handle_fn fn, void *in, size_t in_size, void *out,
                            size_t out_size, int *rv, uint64_t *elapsed) {
    struct dspx_ctx *saved = cur;
    cur = c;
    c->fault = 0;
    c->in = in;
    c->in_size = in_size;
    c->out = out;
    c->out_size = out_size;
    c->tm_handle = TM_TAG | ((c->tm_seed + ++c->tasks * 0x9E3779B97F4A7C15ull) & TM_MASK);
    uint64_t t0 = wall_ns();
    cost_set_l2(c->l2, c->l2_size);
    *rv = fn(in, out, (void *)(uintptr_t)c->tm_handle);
    cost_set_l2(NULL, 0);
    *elapsed = wall_ns() - t0;
    c->tm_handle = 0; /* stale from here on */
    if (dspx_rt_check(c, 0)) { /* the handler broke the runtime: settling could hang on it */
        cur = saved;
        return c->fault;
    }
    settle(c);
    int fault = c->fault;
    c->nregions = 0;
    dspx_rt_check(c, 1);
    c->in = c->out = NULL;
    c->in_size = c->out_size = 0;
    cur = saved;
    return fault;
}

/* The task's printf text since the last call (the newest TEXT_CAP bytes);
 * *dropped counts older bytes that did not fit. */
DSPX_EXPORT size_t dspx_rt_take_text(struct dspx_ctx *c, char *buf, size_t cap, uint64_t *dropped) {
    size_t n = c->text_total < TEXT_CAP ? c->text_total : TEXT_CAP;
    n = n < cap ? n : cap;
    *dropped = c->text_total - n;
    for (size_t i = 0; i < n; i++)
        buf[i] = c->text[(c->text_total - n + i) % TEXT_CAP];
    c->text_total = 0;
    return n;
}
