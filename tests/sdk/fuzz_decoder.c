/* The C client's decoder of device replies, callable from Python (ctypes) for
 * the fuzzer (test_c_fuzz.py, benchmarks/fuzz_c.py): one datagram goes
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
