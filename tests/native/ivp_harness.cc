// Test harness for dspx/ivp.h: one extern "C" entry per intrinsic (and the
// seed's vector functions), called from tests/test_sdk_ivp.py on numpy data.
#include DSPX_SEED  // examples/softmax_c/softmax_ivp.cc: the seed's code, with its statics

typedef xb_vecN_2xf32 V;
typedef xb_vecN_2x32v VI;
static V ldv(const float *p) { dspx_v16f v; memcpy(&v, p, 64); return v; }
static VI ldi(const int32_t *p) { dspx_v16i v; memcpy(&v, p, 64); return v; }
static void stv(float *p, dspx_v16f v) { memcpy(p, &v, 64); }
static void sti(int32_t *p, dspx_v16i v) { memcpy(p, &v, 64); }

extern "C" {
void t_binf(int op, const float *a, const float *b, float *o) {
  V x = ldv(a), y = ldv(b), r;
  switch (op) {
    case 0: r = IVP_ADDN_2XF32(x, y); break;
    case 1: r = IVP_SUBN_2XF32(x, y); break;
    case 2: r = IVP_MULN_2XF32(x, y); break;
    default: r = IVP_MAXN_2XF32(x, y); break;
  }
  stv(o, r);
}
void t_mula(const float *acc, const float *a, const float *b, float *o) {
  V c = ldv(acc);
  IVP_MULAN_2XF32(c, ldv(a), ldv(b));
  stv(o, c);
}
float t_radd(const float *a) { return IVP_RADDN_2XF32(ldv(a)); }
void t_pred(int op, const float *r, const float *a, const float *b, int n, float *o) {
  vboolN_2 t = IVP_LTRSN_2(n);
  V rr = ldv(r);
  if (op == 0) IVP_MAXN_2XF32T(rr, ldv(a), ldv(b), t);
  else if (op == 1) IVP_ADDN_2XF32T(rr, ldv(a), ldv(b), t);
  else rr = IVP_MOVN_2XF32T(ldv(a), ldv(b), t);
  stv(o, rr);
}
void t_cmp(int op, const float *a, const float *b, int32_t *o) {
  vboolN_2 m = op == 0 ? IVP_UNN_2XF32(ldv(a), ldv(b)) : op == 1 ? IVP_ULEN_2XF32(ldv(a), ldv(b))
                                                               : IVP_UEQN_2XF32(ldv(a), ldv(b));
  sti(o, m);
}
void t_ltrs(int n, int32_t *o) { sti(o, IVP_LTRSN_2(n)); }
void t_sel(const float *a, const float *b, int k, float *o) { stv(o, IVP_SELN_2XF32I(ldv(a), ldv(b), k)); }
float t_movf32(const float *a) { return IVP_MOVF32_FROMN_2XF32(ldv(a)); }
void t_trunc(const float *a, int s, int32_t *o) { sti(o, IVP_TRUNCN_2XF32(ldv(a), s)); }
void t_float(const int32_t *x, int s, float *o) { stv(o, IVP_FLOATN_2X32(ldi(x), s)); }
void t_movfi(const int32_t *x, float *o) { stv(o, IVP_MOVN_2XF32_FROMN_2X32(ldi(x))); }
void t_mov16(const int32_t *x, int16_t *o) { xb_vecNx16 h = IVP_MOVNX16_FROMN_2X32(ldi(x)); memcpy(o, &h, 64); }
void t_bini(int op, const int32_t *a, const int32_t *b, int32_t *o) {
  sti(o, op == 0 ? IVP_ADDN_2X32(ldi(a), ldi(b)) : IVP_SUBN_2X32(ldi(a), ldi(b)));
}
void t_shift(int op, const int32_t *x, int s, int32_t *o) {
  sti(o, op == 0 ? IVP_SLLIN_2X32(ldi(x), s) : op == 1 ? IVP_SRLIN_2X32(ldi(x), s) : IVP_SRLIN_2X32U(ldi(x), s));
}
void t_mul0(const int16_t *h, const int32_t *x, int64_t *o) {
  xb_vecNx16 hv; memcpy(&hv, h, 64);
  xb_vecN_2x64w w = IVP_MULN_2X16X32_0(hv, ldi(x));
  memcpy(o, &w, 128);
}
void t_mulah(const int64_t *w0, const int16_t *h, const int32_t *x, int64_t *o) {
  xb_vecNx16 hv; memcpy(&hv, h, 64);
  xb_vecN_2x64w w; memcpy(&w, w0, 128);
  IVP_MULAHN_2X16X32_1(w, hv, ldi(x));
  memcpy(o, &w, 128);
}
void t_packvr(const int64_t *w0, int s, int32_t *o) { xb_vecN_2x64w w; memcpy(&w, w0, 128); sti(o, IVP_PACKVRNRN_2X64W(w, s)); }
void t_packh(const int64_t *w0, int32_t *o) { xb_vecN_2x64w w; memcpy(&w, w0, 128); sti(o, IVP_PACKHN_2X64W(w)); }
void t_lsn(const int32_t *p, int off, int32_t *o) { sti(o, IVP_LSN_2X32_I(p, off)); }
int t_lsrn(const float *p, int inc, float *o) {
  const xtfloat *q = p;
  V v;
  IVP_LSRN_2XF32_XP(v, q, inc);
  stv(o, v);
  return (int)((const char *)q - (const char *)p);
}
int t_la(const float *p, float *o) {  // two aligning loads from any alignment
  const xb_vecN_2xf32 *px = (const xb_vecN_2xf32 *)p;
  valign a = IVP_LAN_2XF32_PP(px);
  V v0, v1;
  IVP_LAN_2XF32_IP(v0, a, px);
  IVP_LAN_2XF32_IP(v1, a, px);
  stv(o, v0); stv(o + 16, v1);
  return (int)((const char *)px - (const char *)p);
}
int t_lavn(const float *p, int n, float *o) {
  const xb_vecN_2xf32 *px = (const xb_vecN_2xf32 *)p;
  valign a = IVP_LAN_2XF32_PP(px);
  V v;
  IVP_LAVN_2XF32_XP(v, a, px, n);
  stv(o, v);
  return (int)((const char *)px - (const char *)p);
}
int t_savn(const float *v, float *dst, int n) {
  xb_vecN_2xf32 *pz = (xb_vecN_2xf32 *)dst;
  valign a = IVP_ZALIGN();
  IVP_SAVN_2XF32_XP(ldv(v), a, pz, n);
  IVP_SAPOSN_2XF32_FP(a, pz);
  return (int)((char *)pz - (char *)dst);
}
int t_san(const float *v, float *dst) {
  xb_vecN_2xf32 *pz = (xb_vecN_2xf32 *)dst;
  valign a = IVP_ZALIGN();
  IVP_SAN_2XF32_IP(ldv(v), a, pz);
  IVP_SAPOSN_2XF32_FP(a, pz);
  return (int)((char *)pz - (char *)dst);
}
float t_vecmaxf(const float *x, int n) { return vecmaxf(x, n); }
void t_vecexpf(float *z, const float *x, int n, float m) { vecexpf_max(z, x, n, m); }
float t_vecsum(const float *x, int n) { return vecsum(x, n); }
void t_vecmul(float *z, const float *x, float s, int n) { vecmul(z, x, s, n); }
int t_softmax(float *x, int n, float *out) { return dsp_softmax(x, n, out); }
// A task (dspx_rt_run) over data the test placed at a page end: the
// aligning loads' guard reads only what lies inside the task's buffers.
struct task_args { int32_t op, n; float s; const float *x; float *z; };
int t_task(void *in, void *out, void *tm) {
  const task_args *a = (const task_args *)in;
  float *o = (float *)out;
  (void)tm;
  switch (a->op) {
    case 0: o[0] = vecmaxf(a->x, a->n); break;
    case 1: o[0] = vecsum(a->x, a->n); break;
    case 2: vecexpf_max(a->z, a->x, a->n, a->s); break;
    case 3: vecmul(a->z, a->x, a->s, a->n); break;
    default: {  // one aligning load at x
      const xb_vecN_2xf32 *px = (const xb_vecN_2xf32 *)a->x;
      valign al = IVP_LAN_2XF32_PP(px);
      V v;
      IVP_LAN_2XF32_IP(v, al, px);
      stv(o, v);
    }
  }
  return 0;
}
const void *t_tables(int which) {
  switch (which) {
    case 0: return expftblf;
    case 1: return &invln2_Q30;
    case 2: return expfminmax;
    case 3: return &minus_inff_;
    default: return &plus_inff;
  }
}
}
