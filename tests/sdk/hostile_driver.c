/* A C client program for test_c_hostile.py's hostile device, built with the
 * library's sources #included and -fsanitize=address,undefined: open,
 * reserve io, INFER (one float32[16] input), then PING, GET_STATUS and
 * POOL_STATUS, printing "key value" lines — every return code, error text,
 * the outputs handed back (as offsets into output_buf) and the stash of kept
 * responses after each call.  argv: socket timeout_ms [infer_count]; with
 * "ucp" as the fourth, the Horizon API instead: two RPC tasks, each waited
 * for twice (a timed-out task stays waitable). */
#include "dspx_conn.c"
#include "c7x_client.c"
#include "hb_ucp.c"

static size_t stash_len(const dspx_conn_t *k) {
    size_t n = 0;
    for (const dspx_stash_t *s = k->stash; s; s = s->next) n++;
    return n;
}

static void said(const char *what, int rc, c7x_client_t *c) {
    printf("%s_rc %d\n%s_error %s\n", what, rc, what, c7x_client_last_error(c));
    printf("%s_stash %zu\n%s_pending %zu\n%s_dropped %llu\n", what, stash_len(&c->conn), what, c->conn.n_pending,
           what, (unsigned long long)c->conn.dropped);
    fflush(stdout);
}

static void ucp_said(const char *what, int rc) {
    printf("%s_rc %d\n%s_error %s\n%s_stash %zu\n%s_pending %zu\n", what, rc, what, hbUCPGetLastErrorText(), what,
           stash_len(&g_conn), what, g_conn.n_pending);
    fflush(stdout);
}

static int ucp(int timeout_ms) {
    hbUCPSysMem in, out;
    ucp_said("malloc", hbUCPMalloc(&in, 64, 0));
    hbUCPMalloc(&out, 64, 0);
    for (int i = 0; i < 2; i++) {
        hbUCPTaskHandle_t t = NULL;
        hbDSPRpcV2(&t, &in, &out, 0x1402);
        ucp_said("submit", hbUCPSubmitTask(t, NULL));
        ucp_said("wait", hbUCPWaitTaskDone(t, timeout_ms));
        ucp_said("wait2", hbUCPWaitTaskDone(t, timeout_ms));
        ucp_said("release", hbUCPReleaseTask(t));
    }
    printf("dropped %llu\n", (unsigned long long)g_conn.dropped);
    hbUCPFree(&in);
    hbUCPFree(&out);
    hbUCPShutdown();
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    if (argc > 4 && !strcmp(argv[4], "ucp")) {
        setenv("DSPX_SOCKET", argv[1], 1);
        return ucp(atoi(argv[2]));
    }
    c7x_client_opts_t o = C7X_CLIENT_OPTS_INIT;
    o.socket_path = argv[1];
    o.timeout_ms = atoi(argv[2]);
    o.printf_to_stderr = 0;
    o.kv_size = 0;
    int rounds = argc > 3 ? atoi(argv[3]) : 1;
    c7x_client_t *c = NULL;
    int rc = c7x_client_open_ex(&c, &o);
    printf("open_rc %d\nopen_error %s\n", rc, c7x_client_open_error());
    if (rc) return 0;
    said("reserve", c7x_client_reserve_io(c, 4096, 4096), c);
    float x[16] = {0};
    c7x_tensor_desc_t in = {x, sizeof x, 1, DSPX_WIRE_DTYPE_FLOAT, 32, 0, {16}}; /* copied into input_buf */
    for (int i = 0; i < rounds; i++) {
        c7x_tensor_desc_t out[4];
        memset(out, 0, sizeof out);
        c7x_infer_info_t info;
        rc = c7x_client_infer(c, 1, 0, &in, 1, out, 4, 0, &info);
        said("infer", rc, c);
        printf("infer_outputs %u\n", info.num_outputs);
        for (uint32_t j = 0; j < info.num_outputs && j < 4 && !rc; j++) {
            /* every byte of an output handed back is readable: ASan says otherwise */
            volatile uint8_t sum = 0;
            for (size_t b = 0; b < out[j].data_size; b++) sum ^= ((const uint8_t *)out[j].data)[b];
            printf("out%u %td %zu %d\n", j, (const uint8_t *)out[j].data - c->output_buf.host, out[j].data_size,
                   out[j].ndim);
        }
    }
    uint32_t version = 0;
    said("ping", c7x_client_ping(c, &version, NULL), c);
    c7x_status_t st;
    said("status", c7x_client_status(c, &st), c);
    c7x_pool_status_t ps;
    said("pool", c7x_client_pool_status(c, &ps), c);
    c7x_client_close(c);
    return 0;
}
