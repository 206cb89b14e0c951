/* The C client's decoder of device replies, callable from Python (ctypes) for
 * the fuzzer (c_fuzz.py: test_c_fuzz.py, benchmarks/fuzz_c.py): one datagram goes
 * through what an INFER reply meets on its way to the caller — the framing
 * check, the type's size, the status, the printf ring, the output
 * descriptors (inline or in output_buf) — against a client whose buffers are
 * heap blocks, so ASan sees any byte read outside them.  Every output handed
 * back is read whole. */
#include "dspx_conn.c"
#include "c7x_client.c"

#define OB_SIZE 8192u
#define ST_SIZE 8192u
#define KV_SIZE 4096u
#define PR_SIZE 1024u
#define OB_ADDR 0xC0200000ull
#define ST_ADDR 0xC0000000ull
#define PR_ADDR 0xC0100000ull
#define MAX_OUT 8

static c7x_client_t C;
static int ready;

static void fake_buf(dspx_buf_t *b, size_t size, uint64_t addr) {
    dspx_buf_init(b);
    b->fd = 1 << 20; /* never a real fd: these are heap blocks, never released */
    b->host = malloc(size);
    b->size = size;
    b->dsp_addr = addr;
}

static void setup(void) {
    memset(&C, 0, sizeof C);
    C.conn.fd = -1;
    C.conn.lost = 1; /* dspx_check asks no GET_ERROR */
    pthread_mutex_init(&C.conn.lock, NULL);
    pthread_mutex_init(&C.conn.pending_lock, NULL);
    fake_buf(&C.output_buf, OB_SIZE, OB_ADDR);
    fake_buf(&C.staging, ST_SIZE, ST_ADDR);
    fake_buf(&C.conn.printf_buf, PR_SIZE, PR_ADDR);
    dspx_buf_init(&C.input_buf);
    C.kv_size = KV_SIZE;
    ready = 1;
}

const char *dspx_fuzz_error(void) { return C.conn.last_error; }

/* One reply of n bytes; ob (ob_n bytes) is what the device wrote at output_buf's
 * start, ring (16 bytes) the printf ring's header.  Returns the client's return
 * code; *decoded gets the outputs handed back. */
int dspx_fuzz_decode(const uint8_t *data, size_t n, const uint8_t *ob, size_t ob_n, const uint8_t *ring,
                     uint32_t printf_read, uint32_t max_outputs, uint32_t *decoded) {
    if (!ready) setup();
    dspx_conn_t *k = &C.conn;
    dspx_clear_error(k);
    *decoded = 0;
    memcpy(C.output_buf.host, ob, ob_n < OB_SIZE ? ob_n : OB_SIZE);
    memcpy(k->printf_buf.host, ring, 16);
    k->printf_read = printf_read;
    uint8_t buf[DSPX_WIRE_MAX_MSG + 1]; /* as recv_one receives it */
    memcpy(buf, data, n < sizeof buf ? n : sizeof buf);
    int rc = dspx_check_frame(k, buf, n);
    if (rc) return rc;
    dspx_wire_header_t h;
    memcpy(&h, buf, sizeof h);
    if (h.type != DSPX_MSG_INFER_RESP && h.type != DSPX_MSG_INFER_LARGE_RESP)
        return dspx_fail(k, -EPROTO, h.status, "response type 0x%04x to INFER", h.type);
    if ((rc = dspx_check_size(k, buf, n))) return rc;
    union {
        dspx_wire_infer_resp_t r;
        uint8_t b[DSPX_WIRE_MAX_MSG + 1];
    } r; /* as dspx_wait hands it over */
    memset(&r, 0, sizeof r);
    memcpy(r.b, buf, n);
    const char *text = dspx_printf_collect(k, r.r.printf_size);
    size_t tl = strlen(text);
    if (tl >= k->printf_cap) return -999; /* the text outgrew its own buffer */
    if ((rc = dspx_check(k, r.b, n, "INFER"))) return rc;
    c7x_tensor_desc_t out[MAX_OUT];
    if (max_outputs > MAX_OUT) max_outputs = MAX_OUT;
    rc = decode_outputs(&C, r.b, n, out, max_outputs);
    uint32_t got = r.r.num_outputs < max_outputs ? r.r.num_outputs : max_outputs;
    if (rc) return rc;
    volatile uint8_t sum = 0;
    for (uint32_t i = 0; i < got; i++)
        for (size_t j = 0; j < out[i].data_size; j++) sum ^= ((const uint8_t *)out[i].data)[j];
    *decoded = got;
    return 0;
}

/* ------------------------------------------------------------------ structure-aware inputs */

/* The fuzzer's bytes, then (when they run out) a generator seeded by them: a
 * short input still fills a whole reply, and replays the same. */
typedef struct {
    const uint8_t *p;
    size_t n, i;
    uint64_t rng;
} src_t;

static uint64_t take(src_t *s, int bytes) {
    uint64_t v = 0;
    for (int b = 0; b < bytes; b++) {
        uint8_t x;
        if (s->i < s->n) {
            x = s->p[s->i++];
        } else { /* splitmix64 */
            uint64_t z = (s->rng += 0x9E3779B97F4A7C15ull);
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
            z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
            x = (uint8_t)(z ^ (z >> 31));
        }
        v = v << 8 | x;
    }
    return v;
}

static uint64_t below(src_t *s, uint64_t n) { return n ? take(s, 2) % n : 0; }

static uint64_t edge(src_t *s, const uint64_t *v, size_t nv) {
    uint64_t x = v[below(s, nv)];
    switch (below(s, 4)) {
    case 0: case 1: return x;
    case 2: return x + below(s, 129) - 64;
    default: return take(s, 8);
    }
}

static const uint64_t ADDRS[] = {
    OB_ADDR - 1, OB_ADDR, OB_ADDR + 1, OB_ADDR + OB_SIZE - 80, OB_ADDR + OB_SIZE - 1, OB_ADDR + OB_SIZE,
    OB_ADDR + OB_SIZE + 1, ST_ADDR + ST_SIZE - KV_SIZE - 1, ST_ADDR + ST_SIZE - KV_SIZE, ST_ADDR + ST_SIZE - 80,
    ST_ADDR + ST_SIZE, ST_ADDR, PR_ADDR, 0, UINT64_MAX, UINT64_MAX - 7, 1ull << 63};
static const uint64_t SIZES[] = {0, 1, 2, 4, 8, 64, 80, 4096, KV_SIZE, OB_SIZE - 1, OB_SIZE, OB_SIZE + 1,
                                 1ull << 31, 1ull << 32, 1ull << 63, UINT64_MAX};
static const uint64_t COUNTS[] = {0, 1, 5, 6, 7, 8, 1u << 31, UINT32_MAX};
static const int32_t DTYPES[][2] = {{0, 8}, {0, 16}, {0, 32}, {0, 64}, {1, 8}, {2, 16}, {2, 32}, {2, 64},
                                    {2, 8}, {0, 12}, {3, 32}, {-1, 32}};
#define N(a) (sizeof(a) / sizeof((a)[0]))

static void make_desc(src_t *s, uint8_t *out) {
    dspx_wire_tensor_desc_t d;
    memset(&d, 0, sizeof d);
    size_t t = below(s, N(DTYPES));
    d.dtype_code = DTYPES[t][0];
    d.dtype_bits = DTYPES[t][1];
    d.ndim = (int32_t)below(s, 9) - 1;
    d.data_addr = edge(s, ADDRS, N(ADDRS));
    if (below(s, 2)) { /* a well-formed tensor, often placed where it fits */
        uint64_t elems = below(s, 2 * OB_SIZE);
        d.ndim = d.ndim < 1 ? 1 : d.ndim > 6 ? 6 : d.ndim;
        d.shape[0] = (int64_t)elems;
        for (int i = 1; i < 6; i++) d.shape[i] = 1;
        d.data_size = elems * (uint64_t)(d.dtype_bits > 0 ? d.dtype_bits : 0) / 8;
        if (below(s, 2)) {
            int kv = (int)below(s, 2);
            uint64_t base = kv ? ST_ADDR + ST_SIZE - KV_SIZE : OB_ADDR, room = kv ? KV_SIZE : OB_SIZE;
            d.data_addr = base + below(s, room > d.data_size ? room - d.data_size + 1 : 1);
        }
    } else {
        static const uint64_t ext[] = {0, 1, 2, 64, 1ull << 58, 1ull << 62, UINT64_MAX};
        for (int i = 0; i < 6; i++) d.shape[i] = (int64_t)edge(s, ext, N(ext));
        d.data_size = edge(s, SIZES, N(SIZES));
    }
    d.reserved = below(s, 8) ? 0 : (int32_t)below(s, 10);
    memcpy(out, &d, sizeof d);
}

/* ------------------------------------------------------------------ outcomes */

/* Distinct outcomes: return code, outputs handed back, the error text without its numbers. */
#define OUTCOMES 1024
static struct outcome {
    uint64_t count;
    int rc;
    uint32_t decoded;
    char text[160];
} outcomes[OUTCOMES];
static size_t n_outcomes;

static void count_outcome(int rc, uint32_t decoded) {
    char t[160];
    size_t j = 0;
    for (const char *e = C.conn.last_error; *e && j + 2 < sizeof t; e++) {
        if (e[0] == '0' && e[1] == 'x') { /* a hex number */
            e += 2;
            while (e[1] && strchr("0123456789abcdef", e[1])) e++;
            t[j++] = '#';
        } else if ((*e >= '0' && *e <= '9') || (*e == '-' && e[1] >= '0' && e[1] <= '9')) {
            while (e[1] >= '0' && e[1] <= '9') e++;
            t[j++] = '#';
        } else {
            t[j++] = *e;
        }
    }
    t[j] = 0;
    uint64_t h = 1469598103934665603ull ^ (uint64_t)(uint32_t)rc ^ ((uint64_t)decoded << 32);
    for (size_t i = 0; i < j; i++) h = (h ^ (uint8_t)t[i]) * 0x100000001B3ull;
    for (size_t k = 0; k < OUTCOMES; k++) {
        struct outcome *o = &outcomes[(h + k) % OUTCOMES];
        if (!o->count) {
            o->rc = rc;
            o->decoded = decoded;
            memcpy(o->text, t, j + 1);
            n_outcomes++;
        } else if (o->rc != rc || o->decoded != decoded || strcmp(o->text, t)) {
            continue;
        }
        o->count++;
        return;
    }
}

/* The i-th slot of the outcome table (count 0: empty). */
uint64_t dspx_fuzz_outcome(size_t i, int *rc, uint32_t *decoded, const char **text) {
    if (i >= OUTCOMES) return 0;
    *rc = outcomes[i].rc;
    *decoded = outcomes[i].decoded;
    *text = outcomes[i].text;
    return outcomes[i].count;
}

static int fuzz_input(const uint8_t *raw, size_t n, uint32_t *decoded);

/* One structure-aware input from the fuzzer's bytes: the decoder's return code (outcome counted). */
int dspx_fuzz_bytes(const uint8_t *raw, size_t n) {
    uint32_t decoded = 0;
    int rc = fuzz_input(raw, n, &decoded);
    count_outcome(rc, decoded);
    return rc;
}

static int fuzz_input(const uint8_t *raw, size_t n, uint32_t *decoded) {
    src_t s = {raw, n, 0, 0x2545F4914F6CDD1Dull};
    for (size_t i = 0; i < n; i++) s.rng = (s.rng ^ raw[i]) * 0x100000001B3ull;
    static const uint32_t types[] = {DSPX_MSG_INFER_LARGE_RESP, DSPX_MSG_PING_RESP, DSPX_MSG_INFER, 0};
    uint8_t msg[1200], ob[1024];
    memset(msg, 0, sizeof msg);
    dspx_wire_infer_resp_t r;
    memset(&r, 0, sizeof r);
    r.hdr.type = below(&s, 10) < 9 ? DSPX_MSG_INFER_RESP : types[below(&s, 4)];
    r.hdr.seq = 7;
    r.hdr.status = below(&s, 5) < 4 ? 0 : below(&s, 2) ? (int32_t)below(&s, 19) - 16 : (int32_t)take(&s, 4);
    uint32_t inline_n = (uint32_t)below(&s, 7);
    r.num_outputs = below(&s, 3) < 2 ? inline_n : (uint32_t)edge(&s, COUNTS, N(COUNTS));
    int table = below(&s, 3) == 0;
    if (table) {
        r.descs_addr = edge(&s, ADDRS, N(ADDRS));
        const uint64_t dsz[] = {80ull * r.num_outputs, 0, 80, 79, 81, OB_SIZE, UINT32_MAX};
        r.descs_size = (uint32_t)edge(&s, dsz, N(dsz));
    }
    const uint64_t psz[] = {1, PR_SIZE, 1u << 31};
    r.printf_size = below(&s, 2) ? 0 : (uint32_t)edge(&s, psz, N(psz));
    r.return_value = (int32_t)take(&s, 4);
    r.result_required = edge(&s, SIZES, N(SIZES));
    memcpy(msg, &r, sizeof r);
    size_t len = sizeof r;
    for (uint32_t i = 0; i < inline_n; i++, len += 80) make_desc(&s, msg + len);
    if (below(&s, 8) == 7) { /* truncated or extended */
        size_t to = below(&s, 601);
        for (size_t i = len; i < to && i < sizeof msg; i++) msg[i] = (uint8_t)take(&s, 1);
        len = to;
    }
    const uint64_t lens[] = {0, 16, 68, 148, 512, 513};
    uint32_t lf = below(&s, 10) < 9 ? (uint32_t)len : (uint32_t)edge(&s, lens, N(lens));
    if (len >= 12) memcpy(msg + 8, &lf, 4);
    size_t ob_n = 0;
    memset(ob, 0, sizeof ob);
    if (table && r.descs_addr >= OB_ADDR && r.descs_addr - OB_ADDR < sizeof ob) { /* the table where it says */
        ob_n = r.descs_addr - OB_ADDR;
        for (uint32_t i = below(&s, 9); i > 0 && ob_n + 80 <= sizeof ob; i--, ob_n += 80) make_desc(&s, ob + ob_n);
    }
    const uint64_t caps[] = {17, 16, 0, PR_SIZE, PR_SIZE + 1, 1u << 31};
    uint32_t ring[4];
    ring[2] = (uint32_t)edge(&s, caps, N(caps));
    ring[0] = below(&s, 6) < 5 ? (uint32_t)DSPX_WIRE_PRINTF_MAGIC : (uint32_t)take(&s, 4);
    const uint64_t widx[] = {0, 1, ring[2] - 16u, ring[2] - 15u, PR_SIZE};
    ring[1] = (uint32_t)edge(&s, widx, N(widx));
    ring[3] = 0;
    uint32_t printf_read = (uint32_t)edge(&s, widx, N(widx));
    uint32_t max_out = (uint32_t)below(&s, 10);
    return dspx_fuzz_decode(msg, len, ob, ob_n, (const uint8_t *)ring, printf_read, max_out, decoded);
}
