// Firmware softmax, cmd 0x1402: the UCP seed's operator (softmax_ivp.cc)
// through the dspx SDK, with both of its paths: direct over DDR, and
// ping-pong through the two L2 banks with IDMA.  The seed's vector
// functions are here as it lists them but for one fix (marked dspx:).
// What differs from the seed's hb_dsp_softmax, as firmware must:
//  * the parameter struct and buffer sizes are checked (ERR_SIZE/ERR_INVALID);
//  * exp and sum go a block of 1024 floats at a time, the sum by the seed's
//    vecsum and added in double: one pass over DDR fewer, and no drift past
//    1e-6 (the seed's 32 float lanes drift on millions of floats);
//  * the ping-pong max starts at -inf (the seed's 0 is wrong for inputs
//    below -88), and a non-finite max gives NaN everywhere, like numpy.
#include <dspx/dsp.h>

#ifndef BUILTIN_TILE_SIZE
#define BUILTIN_TILE_SIZE (256 * 1024)
#endif
#ifndef SUM_BLOCK
#define SUM_BLOCK 1024
#endif

#define ST_INVALID (-2)
#define ST_NOMEM (-3)
#define ST_SIZE (-7)

typedef struct {
  int32_t data_size;
  uint64_t input;
  uint8_t run_tcm_opt;
} hbDSPSoftmaxParam;

/**
 * DSP find max value
 * @param[in] x: input
 * @param[in] N: length
 * @return maximum value
 */
float32_t vecmaxf(const float32_t *x, int32_t N) {
  const xb_vecN_2xf32 *restrict px;
  valign al_px;
  xb_vecN_2xf32 vecmax0, vecmax1, vecx0, vecx1;
  vboolN_2 b_max0, b_max1;
  int32_t n, N_tail, Nb_tail;
  float32_t max;

  // ASSERT( x );
  if (N <= 0) return 0.f;

  px = (const xb_vecN_2xf32 *)x;
  al_px = IVP_LAN_2XF32_PP(px);
  vecmax0 = vecmax1 = minus_inff_.f;

  /* Main loop: process by 2*IVP_N_2 values per iteration */
  for (n = 0; n<N>> (LOG2_IVP_N_2 + 1); n++) {
    IVP_LAN_2XF32_IP(vecx0, al_px, px);
    IVP_LAN_2XF32_IP(vecx1, al_px, px);
    vecmax0 = IVP_MAXN_2XF32(vecx0, vecmax0);
    vecmax1 = IVP_MAXN_2XF32(vecx1, vecmax1);
  }
  /* Process last N%(2*IVP_N_2) values */
  N_tail = N & (2 * IVP_N_2 - 1);
  Nb_tail = N_tail * sizeof(float32_t);
  b_max0 = IVP_LTRSN_2(N_tail);
  b_max1 = IVP_LTRSN_2(N_tail - IVP_N_2);
  IVP_LAVN_2XF32_XP(vecx0, al_px, px, Nb_tail);
  IVP_LAVN_2XF32_XP(vecx1, al_px, px, Nb_tail - IVP_N_2 * sizeof(float32_t));
  IVP_MAXN_2XF32T(vecmax0, vecx0, vecmax0, b_max0);
  IVP_MAXN_2XF32T(vecmax1, vecx1, vecmax1, b_max1);
  /* Reduce maximium values from vectors to the scalar one */
#ifdef IVP_SELI_32B_ROTATE_RIGHT_16
  vecmax0 = IVP_MAXN_2XF32(vecmax0, vecmax1);
  vecmax1 = IVP_SELN_2XF32I(vecmax0, vecmax0, IVP_SELI_32B_ROTATE_RIGHT_16);
#endif
  vecmax0 = IVP_MAXN_2XF32(vecmax0, vecmax1);
  vecmax1 = IVP_SELN_2XF32I(vecmax0, vecmax0, IVP_SELI_32B_ROTATE_RIGHT_8);
  vecmax0 = IVP_MAXN_2XF32(vecmax0, vecmax1);
  vecmax1 = IVP_SELN_2XF32I(vecmax0, vecmax0, IVP_SELI_32B_ROTATE_RIGHT_4);
  vecmax0 = IVP_MAXN_2XF32(vecmax0, vecmax1);
  vecmax1 = IVP_SELN_2XF32I(vecmax0, vecmax0, IVP_SELI_32B_ROTATE_RIGHT_2);
  vecmax0 = IVP_MAXN_2XF32(vecmax0, vecmax1);
  vecmax1 = IVP_SELN_2XF32I(vecmax0, vecmax0, IVP_SELI_32B_ROTATE_RIGHT_1);
  vecmax0 = IVP_MAXN_2XF32(vecmax0, vecmax1);
  max = IVP_MOVF32_FROMN_2XF32(vecmax0);

  return max;
} /* vecmaxf() */

/**
 * DSP Vectorized Floating-Point Exponential
 * The exponential (or anti-logarithm) function computes the exponential
 * value e to the power of input vector x[N], and stores the result to output
 * vector z[N].
 * @param[out] z: output
 * @param[in] x: input
 * @param[in] N: length
 * @param[in] max_value: max_value
 * @return maximum value
 */
void vecexpf_max(float32_t *z, const float32_t *x, int32_t N,
                 float32_t max_value) {
  const xb_vecN_2xf32 *restrict px = (const xb_vecN_2xf32 *)x;
  xb_vecN_2xf32 *restrict pz = (xb_vecN_2xf32 *)z;
  xtfloat *restrict ptbl = (xtfloat *)expftblf;

  // check correct
  xb_vecN_2xf32 xmax = max_value;
  xb_vecN_2xf32 xin, xin2, txin, zout;
  xb_vecN_2xf32 p0, p1, p2, p3, p4, p5, p6;
  xb_vecN_2xf32 scl1, scl2;
  xb_vecN_2x32v t, exp_fract, exp_int, e1, e2;
  xb_vecN_2x64w W;
  xb_vecNx16 invln2;
  valign xa, za;
  vboolN_2 b_nan __attribute__((unused)), b_max, b_inf;
#if EXPF_ERRH != 0
  vboolN_2 b_edom, b_erange;
  xb_int32v SCF; /* Floating-point Status and Control Register values. */
#endif
  int32_t n;

  /* common argument checks */
  // NASSERT(x);
  // NASSERT(z);
  if (N <= 0) return;

  /* load 1/ln(2) constant in Q30 */
  invln2 =
      IVP_MOVNX16_FROMN_2X32(IVP_LSN_2X32_I((const int32_t *)&invln2_Q30, 0));

  za = IVP_ZALIGN();
  xa = IVP_LAN_2XF32_PP(px);

  for (n = 0; n<(N + IVP_N_2 - 1)>> LOG2_IVP_N_2; n++) {
    IVP_LAVN_2XF32_XP(xin, xa, px, (uint8_t *)x + N * 4 - (uint8_t *)px);

    txin = xin;
    /* Check input for values that are out of domain/range */
    b_nan = IVP_UNN_2XF32(xin, xin);              /* x==NaN                */
    b_inf = IVP_UEQN_2XF32(xin, plus_inff.f);     /* x==+Inf or x==NaN     */

    /* Limit input values to [-128;+127] and replace NaNs *
     * with some numbers to avoid unnecessary exceptions  */
    xin = IVP_SUBN_2XF32(xin, xmax);
    /* dspx: the overflow test is on x - max, not x (the seed's test on x
     * sends every x >= 88.72 to exp(127), whatever the max) */
    b_max = IVP_ULEN_2XF32(expfminmax[1].f, xin); /* x-max>=88.72284 or NaN */
    xin = IVP_MOVN_2XF32T(127.0f, xin, b_max);
    xin = IVP_MAXN_2XF32(xin, -128.0f);
    /* Convert the input to Q24 and scale to 1/ln(2) */
    t = IVP_TRUNCN_2XF32(xin, 24);
    W = IVP_MULN_2X16X32_0(invln2, t);
    IVP_MULAHN_2X16X32_1(W, invln2, t); /* Q24*Q30->Q54 */

    /* Separate input to positive fractional part and integer part */
    exp_fract = IVP_PACKVRNRN_2X64W(W, 22);    /* Q54->Q32 */
    exp_fract = IVP_SRLIN_2X32U(exp_fract, 1); /* Q32->Q31 */
    exp_int = IVP_PACKHN_2X64W(W);             /* Q54->Q22 */
    exp_int = IVP_SRLIN_2X32(exp_int, 22);     /* Q22->Q0 */

    /* compute 2^fract in floating-point format */
    xin =
        IVP_FLOATN_2X32(exp_fract, 31); /* scale fraction part by 2^-31 with */
    /* conversion from int32_t to float32_t */

    /* Pass input to the output if x==+INF or x==NaN */
    xin = IVP_MOVN_2XF32T(txin, xin, b_inf);
    /* load polynomial coefficients */
    IVP_LSRN_2XF32_IP(p0, ptbl, sizeof(float32_t));
    IVP_LSRN_2XF32_IP(p1, ptbl, sizeof(float32_t));
    IVP_LSRN_2XF32_IP(p2, ptbl, sizeof(float32_t));
    IVP_LSRN_2XF32_IP(p3, ptbl, sizeof(float32_t));
    IVP_LSRN_2XF32_IP(p4, ptbl, sizeof(float32_t));
    IVP_LSRN_2XF32_IP(p5, ptbl, sizeof(float32_t));
    IVP_LSRN_2XF32_XP(p6, ptbl, -6 * (int32_t)sizeof(float32_t));
    /* compute polynomial using combination *
     * of Estrin`s and Horner schemes       */
    xin2 = IVP_MULN_2XF32(xin, xin);
    IVP_MULAN_2XF32(p1, xin, p0);
    IVP_MULAN_2XF32(p3, xin, p2);
    IVP_MULAN_2XF32(p5, xin, p4);

    IVP_MULAN_2XF32(p3, xin2, p1);
    IVP_MULAN_2XF32(p5, xin2, p3);

    IVP_MULAN_2XF32(p6, xin, p5);

    /* Apply integer exponential part to the result */
    exp_int = IVP_ADDN_2X32(exp_int, 254);
    e1 = IVP_SRLIN_2X32(exp_int, 1);
    e2 = IVP_SUBN_2X32(exp_int, e1);
    e1 = IVP_SLLIN_2X32(e1, 23);
    e2 = IVP_SLLIN_2X32(e2, 23);
    scl1 = IVP_MOVN_2XF32_FROMN_2X32(e1);
    scl2 = IVP_MOVN_2XF32_FROMN_2X32(e2);
    zout = IVP_MULN_2XF32(p6, scl1);
    zout = IVP_MULN_2XF32(zout, scl2);

    IVP_SAVN_2XF32_XP(zout, za, pz, (uint8_t *)z + N * 4 - (uint8_t *)pz);
  }
  IVP_SAPOSN_2XF32_FP(za, pz);
} /* vecexpf() */

/**
 * DSP Vectorized sum value
 * @param[in] x: input
 * @param[in] N: length
 * @return sum of x[N] value
 */
static float32_t vecsum(const float32_t *x, int32_t N) {
  const xb_vecN_2xf32 *restrict px;
  valign al_px;
  xb_vecN_2xf32 vecsum0, vecsum1, vecx0, vecx1;
  vboolN_2 b_sum0, b_sum1;
  int32_t n, N_tail, Nb_tail;
  float32_t sum;

  // ASSERT(x);
  if (N <= 0) return 0.f;
  px = (const xb_vecN_2xf32 *)x;
  al_px = IVP_LAN_2XF32_PP(px);
  vecsum0 = vecsum1 = 0.f;
  for (n = 0; n<N>> (LOG2_IVP_N_2 + 1); n++) {
    IVP_LAN_2XF32_IP(vecx0, al_px, px);
    IVP_LAN_2XF32_IP(vecx1, al_px, px);
    vecsum0 = IVP_ADDN_2XF32(vecx0, vecsum0);
    vecsum1 = IVP_ADDN_2XF32(vecx1, vecsum1);
  }
  N_tail = N & (2 * IVP_N_2 - 1);
  Nb_tail = N_tail * sizeof(float32_t);
  b_sum0 = IVP_LTRSN_2(N_tail);
  b_sum1 = IVP_LTRSN_2(N_tail - IVP_N_2);
  IVP_LAVN_2XF32_XP(vecx0, al_px, px, Nb_tail);
  IVP_LAVN_2XF32_XP(vecx1, al_px, px, Nb_tail - IVP_N_2 * sizeof(float32_t));
  IVP_ADDN_2XF32T(vecsum0, vecx0, vecsum0, b_sum0);
  IVP_ADDN_2XF32T(vecsum1, vecx1, vecsum1, b_sum1);

  vecsum0 = IVP_ADDN_2XF32(vecsum0, vecsum1);
  sum = IVP_RADDN_2XF32(vecsum0);
  return sum;
}

/**
 * DSP Vectorized multiply
 * @param[out] z: output
 * @param[in] x1: multiply left input
 * @param[in] x2: multiply right input
 * @param[in] N: length
 */
static void vecmul(float32_t *z, const float32_t *x1, const float32_t x2,
                   int32_t N) {
  const xb_vecN_2xf32 *restrict px;
  xb_vecN_2xf32 *restrict pz;
  valign al_px, al_pz;

  px = (const xb_vecN_2xf32 *)x1;
  pz = (xb_vecN_2xf32 *)z;
  xb_vecN_2xf32 px2 = x2;

  al_px = IVP_LAN_2XF32_PP(px);
  al_pz = IVP_ZALIGN();

  int32_t n, modN;
  modN = (N & (IVP_N_2 - 1)) * sizeof(float32_t);
  xb_vecN_2xf32 in, out;
  for (n = 0; n<N>> LOG2_IVP_N_2; n++) {
    IVP_LAN_2XF32_IP(in, al_px, px);
    out = IVP_MULN_2XF32(in, px2);
    IVP_SAN_2XF32_IP(out, al_pz, pz);
  }

  IVP_LAN_2XF32_IP(in, al_px, px);
  out = IVP_MULN_2XF32(in, px2);
  IVP_SAVN_2XF32_XP(out, al_pz, pz, modN);
  IVP_SAPOSN_2XF32_FP(al_pz, pz);
}


/* exp(x - max) into z, and its sum: a block at a time, each summed by the
 * seed's vecsum while still in L1 and added in double. */
static double vecexpf_sum(float32_t *z, const float32_t *x, int32_t N, float32_t max_value) {
  double total = 0;
  for (int32_t i = 0; i < N; i += SUM_BLOCK) {
    int32_t n = XT_MIN(SUM_BLOCK, N - i);
    vecexpf_max(z + i, x + i, n, max_value);
    total += vecsum(z + i, n);
  }
  return total;
}

static void fill_nan(float32_t *dst, int32_t N) {
  for (int32_t i = 0; i < N; i++) dst[i] = NAN;
}

static int32_t dsp_softmax(float32_t *input, int32_t length, float32_t *output) {
  float32_t max_value = vecmaxf(input, length);
  if (!isfinite(max_value)) {
    fill_nan(output, length);
    return 0;
  }
  double sum = vecexpf_sum(output, input, length, max_value);
  vecmul(output, output, (float32_t)(1.0 / sum), length);
  return 0;
}

/* Ping-pong in the seed's three frames: the max; exp(x - max) and its sum
 * (per 1 KiB block, as in the direct path), written back; the scaling.
 * Both paths compute every element with the same operations, so they
 * agree bit for bit. */
struct tile_state {
  float32_t max;
  double sum;
  float32_t scale;
};

typedef void (*tile_fn)(float32_t *out, float32_t *in, int32_t size, struct tile_state *st);

static void tile_max(float32_t *out, float32_t *in, int32_t size, struct tile_state *st) {
  (void)out;
  st->max = XT_MAX(st->max, vecmaxf(in, size));
}

static void tile_exp_sum(float32_t *out, float32_t *in, int32_t size, struct tile_state *st) {
  st->sum += vecexpf_sum(out, in, size, st->max);
}

static void tile_scale(float32_t *out, float32_t *in, int32_t size, struct tile_state *st) {
  vecmul(out, in, st->scale, size);
}

/* The seed's hb_dsp_ping_pong_frame: fetch tile k+1 into one bank while
 * tile k is computed in the other; copies back on the same channel, so the
 * next fetch into a bank queues behind its write-back. */
static int32_t ping_pong_frame(float32_t *dst, float32_t *src, void *src_idma[], void *dst_idma[],
                               int32_t length, tile_fn func, struct tile_state *st, bool with_out_idma) {
  int32_t size[] = {0, 0};
  int32_t vret_in[2], vret_out[2];
  int32_t i = 0, block_start = 0, output_start = 0, ping_pong = 0;
  int32_t block = XT_MIN(BUILTIN_TILE_SIZE >> 2, length);
  size[0] = block;
  IDMA_COPY(HB_IDMA_CH0, vret_in[0], src, src_idma[0], block << 2)
  if (vret_in[0] < 0) return vret_in[0];
  block_start += block;
  if (block_start < length) {
    block = XT_MIN(block, length - block_start);
    size[1] = block;
    IDMA_COPY(HB_IDMA_CH1, vret_in[1], src + block_start, src_idma[1], block << 2)
    if (vret_in[1] < 0) return vret_in[1];
    block_start += block;
  }
  while (i < length) {
    i += size[ping_pong];
    IDMA_WAIT(ping_pong, vret_in[ping_pong])
    if (vret_in[ping_pong] < 0) return vret_in[ping_pong];
    func((float32_t *)dst_idma[ping_pong], (float32_t *)src_idma[ping_pong], size[ping_pong], st);
    if (with_out_idma) {
      IDMA_COPY(ping_pong, vret_out[ping_pong], dst_idma[ping_pong], dst + output_start, size[ping_pong] << 2)
      if (vret_out[ping_pong] < 0) return vret_out[ping_pong];
      output_start += size[ping_pong];
    }
    if (block_start < length) {
      block = XT_MIN(block, length - block_start);
      size[ping_pong] = block;
      IDMA_COPY(ping_pong, vret_in[ping_pong], src + block_start, src_idma[ping_pong], block << 2)
      if (vret_in[ping_pong] < 0) return vret_in[ping_pong];
      block_start += block;
    }
    ping_pong ^= 0x1;
  }
  int32_t ret = 0;
  for (int32_t ch = 0; ch < 2; ch++) { /* the last write-backs */
    IDMA_WAIT(ch, ret)
    if (ret < 0) return ret;
  }
  return 0;
}

static int32_t softmax_ping_pong(float32_t *src, float32_t *dst, int32_t length, xvTileManager *tm) {
  float32_t *src_0 = (float32_t *)xvAllocateBuffer(tm, BUILTIN_TILE_SIZE, XV_MEM_BANK_COLOR_0, IVP_2N);
  float32_t *src_1 = (float32_t *)xvAllocateBuffer(tm, BUILTIN_TILE_SIZE, XV_MEM_BANK_COLOR_1, IVP_2N);
  int32_t ret = src_0 && src_1 ? 0 : ST_NOMEM;
  void *src_idma[] = {src_0, src_1};
  void *dst_idma[] = {src_0, src_1};
  struct tile_state st = {minus_inff_.f, 0.0, 0.0f};
  if (ret == 0) ret = ping_pong_frame(dst, src, src_idma, dst_idma, length, tile_max, &st, false);
  if (ret == 0 && !isfinite(st.max)) {
    fill_nan(dst, length);
  } else if (ret == 0) {
    ret = ping_pong_frame(dst, src, src_idma, dst_idma, length, tile_exp_sum, &st, true);
    st.scale = (float32_t)(1.0 / st.sum);
    if (ret == 0) ret = ping_pong_frame(dst, dst, src_idma, dst_idma, length, tile_scale, &st, true);
  }
  if (src_1) xvFreeBuffer(tm, src_1);
  if (src_0) xvFreeBuffer(tm, src_0);
  return ret;
}

static int hb_dsp_softmax(void *input, void *output, void *tm) {
  if (dspx_input_size() < sizeof(hbDSPSoftmaxParam)) {
    printf("softmax: input holds %zu bytes, the parameter struct needs %zu\n", dspx_input_size(),
           sizeof(hbDSPSoftmaxParam));
    return ST_SIZE;
  }
  hbDSPSoftmaxParam *ptr = (hbDSPSoftmaxParam *)(input);
  if (ptr->data_size < 0 || ptr->data_size % 4) {
    printf("softmax: data_size %d is not a whole number of float32s\n", ptr->data_size);
    return ST_INVALID;
  }
  if (dspx_output_size() < (size_t)ptr->data_size) {
    printf("softmax: output holds %zu bytes, data_size is %d\n", dspx_output_size(), ptr->data_size);
    return ST_SIZE;
  }
  if (ptr->data_size == 0) return 0;
  float32_t *src = (float32_t *)hb_dsp_mem_map(ptr->input, ptr->data_size);
  PRT_IF_COND_RETURN(MAP_FAILED == src, HB_ERR_MMAP_FAILED)
  float32_t *dst = (float32_t *)(output);
  int32_t length = ptr->data_size >> 2;
  int32_t ret;
  TIME_STAMP(cycles_start);
  if (ptr->run_tcm_opt) {
    ret = softmax_ping_pong(src, dst, length, (xvTileManager *)tm);
    TIME_STAMP(cycles_stop);
    if (ret == 0) DSP_LOGI("find softmax ping-pong tcm is %llu cycles", (unsigned long long)(cycles_stop - cycles_start));
  } else {
    ret = dsp_softmax(src, length, dst);
    TIME_STAMP(cycles_stop);
    if (ret == 0) DSP_LOGI("find softmax ddr tcm is %llu cycles", (unsigned long long)(cycles_stop - cycles_start));
  }
  hb_dsp_mem_unmap((uintptr_t)src);
  return ret;
}

extern "C" int dspx_ops_init(void) {
  return hb_dsp_register_fn(0x1402, hb_dsp_softmax, 0);
}
