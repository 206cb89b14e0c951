/* libdspx: the TI-shaped client (c7x_client_*), same flow and capacity
 * rules as src/dspx/host/client.py (docs/protocol.md, "Capacity"):
 *   open: PING (major version check), printf ring + SET_PRINTF_BUF;
 *   first DYN_LOAD / MODEL_LOAD: staging buffer (ATTACH_STAGING, sized to
 *   need, KV region at its end); DYN_LOAD's io fields size input_buf /
 *   output_buf (grow, never shrink; an unmeetable declaration is advisory);
 *   input over capacity: -EFBIG on the host before anything is staged;
 *   output over capacity: the device's ERR_SIZE (-ENOSPC) with result_required;
 *   reserve_io refused (-EPERM) once capacity is locked by first use. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "c7x_client.h"
#include "dspx_internal.h"
#include "dspx_shape.h"

#define RETIRED_MAX 8

struct c7x_client {
    dspx_conn_t conn;
    c7x_client_opts_t opts;
    dspx_buf_t staging;
    size_t kv_size;
    dspx_buf_t input_buf, output_buf;
    size_t input_data_offset, create_input_end;
    uint32_t declared_inputs;
    int io_locked;
    /* input_bufs replaced after the lock: create_input tensors may still point
     * into them, so their mappings live until close (detached from the device) */
    dspx_buf_t retired[RETIRED_MAX];
    int n_retired;
};

#define KV_DEFAULT ((size_t)DSPX_WIRE_KV_SIZE)
#define PRINTF_DEFAULT ((size_t)DSPX_WIRE_PRINTF_SIZE)

DSPX_API const char *c7x_status_name(int32_t status) { return dspx_wire_status_name(status); }
DSPX_API const char *c7x_client_open_error(void) { return dspx_open_error(); }

DSPX_API int c7x_client_open_ex(c7x_client_t **out, const c7x_client_opts_t *opts) {
    if (!out) return -EINVAL;
    *out = NULL;
    c7x_client_opts_t o = C7X_CLIENT_OPTS_INIT;
    if (opts) o = *opts;
    if (o.kv_size == (size_t)-1) o.kv_size = KV_DEFAULT;
    if (o.printf_size == (size_t)-1) o.printf_size = PRINTF_DEFAULT;
    if (o.kv_size % 64) return dspx_set_open_error(-EINVAL, "kv_size %zu is not a multiple of 64", o.kv_size);
    c7x_client_t *c = calloc(1, sizeof *c);
    if (!c) return dspx_set_open_error(-ENOMEM, "out of host memory");
    int rc = dspx_conn_open(&c->conn, o.socket_path, o.timeout_ms);
    if (rc) {
        free(c);
        return rc;
    }
    c->opts = o;
    c->conn.printf_to_stderr = o.printf_to_stderr;
    dspx_buf_init(&c->staging);
    dspx_buf_init(&c->input_buf);
    dspx_buf_init(&c->output_buf);
    rc = dspx_conn_handshake(&c->conn, o.printf_size);
    if (rc) {
        dspx_set_open_error(rc, "%s", c->conn.last_error);
        c7x_client_close(c);
        return rc;
    }
    dspx_clear_error(&c->conn);
    *out = c;
    return 0;
}

DSPX_API int c7x_client_open(c7x_client_t **out, const char *socket_path) {
    c7x_client_opts_t o = C7X_CLIENT_OPTS_INIT;
    o.socket_path = socket_path;
    return c7x_client_open_ex(out, &o);
}

DSPX_API void c7x_client_close(c7x_client_t *c) {
    if (!c) return;
    /* The socket first: the device frees everything the connection attached. */
    if (c->conn.fd >= 0) close(c->conn.fd);
    c->conn.fd = -1;
    dspx_buf_release(&c->staging);
    dspx_buf_release(&c->input_buf);
    dspx_buf_release(&c->output_buf);
    for (int i = 0; i < c->n_retired; i++) dspx_buf_release(&c->retired[i]);
    dspx_conn_close(&c->conn);
    free(c);
}

DSPX_API const char *c7x_client_last_error(const c7x_client_t *c) { return c ? c->conn.last_error : dspx_open_error(); }
DSPX_API int32_t c7x_client_last_status(const c7x_client_t *c) { return c ? c->conn.last_status : 0; }
DSPX_API uint64_t c7x_client_result_required(const c7x_client_t *c) { return c ? c->conn.result_required : 0; }
DSPX_API void c7x_client_last_oom(const c7x_client_t *c, uint32_t *requested, uint32_t *free_bytes, uint32_t *total) {
    if (requested) *requested = c ? c->conn.oom_requested : 0;
    if (free_bytes) *free_bytes = c ? c->conn.oom_free : 0;
    if (total) *total = c ? c->conn.oom_total : 0;
}
DSPX_API uint32_t c7x_client_device_version(const c7x_client_t *c) { return c ? c->conn.device_version : 0; }
DSPX_API const char *c7x_client_printf_text(const c7x_client_t *c) {
    return c && c->conn.printf_text ? c->conn.printf_text : "";
}

#define BEGIN(c)                       \
    do {                               \
        if (!(c)) return -EINVAL;      \
        dspx_clear_error(&(c)->conn);  \
    } while (0)

/* ------------------------------------------------------------------ basics */

DSPX_API int c7x_client_ping(c7x_client_t *c, uint32_t *version, uint32_t *uptime_ms) {
    BEGIN(c);
    dspx_wire_ping_t m = {{DSPX_MSG_PING, 0, 0, 0}};
    dspx_wire_ping_resp_t r;
    int rc = dspx_request(&c->conn, &m, sizeof m, -1, &r, sizeof r, NULL, 0);
    if (rc) return rc;
    if (version) *version = r.version;
    if (uptime_ms) *uptime_ms = r.uptime_ms;
    return 0;
}

DSPX_API int c7x_client_status(c7x_client_t *c, c7x_status_t *out) {
    BEGIN(c);
    dspx_wire_get_status_t m = {{DSPX_MSG_GET_STATUS, 0, 0, 0}};
    dspx_wire_get_status_resp_t r;
    int rc = dspx_request(&c->conn, &m, sizeof m, -1, &r, sizeof r, NULL, 0);
    if (rc) return rc;
    if (out) {
        out->version = r.version;
        out->uptime_ms = r.uptime_ms;
        out->jobs_completed = r.jobs_completed;
        out->jobs_failed = r.jobs_failed;
    }
    return 0;
}

DSPX_API int c7x_client_pool_status(c7x_client_t *c, c7x_pool_status_t *out) {
    BEGIN(c);
    dspx_wire_pool_status_t m = {{DSPX_MSG_POOL_STATUS, 0, 0, 0}};
    dspx_wire_pool_status_resp_t r;
    int rc = dspx_request(&c->conn, &m, sizeof m, -1, &r, sizeof r, NULL, 0);
    if (rc) return rc;
    if (out) {
        out->ddr_total = r.ddr_total;
        out->ddr_used = r.ddr_used;
        out->ddr_peak = r.ddr_peak;
        out->carveout_total = r.carveout_total;
        out->carveout_used = r.carveout_used;
        out->l2_total = r.l2_total;
        out->l2_used = r.l2_used;
        out->connections = r.connections;
        out->modules = r.modules;
        out->cores = r.cores;
        out->op_count = r.op_count;
        out->rss_bytes = r.rss_bytes;
    }
    return 0;
}

/* ------------------------------------------------------------------ staging */

static int ensure_staging(c7x_client_t *c, size_t need) {
    dspx_conn_t *k = &c->conn;
    if (c->staging.fd >= 0 && c->staging.size - c->kv_size >= need) return 0;
    size_t room = need > c->opts.staging_size ? need : c->opts.staging_size;
    if (c->staging.fd >= 0) {
        /* A bigger load than the staging area holds: replace it (the KV
         * region's contents go with it). */
        int rc = dspx_detach(k, &c->staging);
        dspx_buf_release(&c->staging);
        if (rc) return rc;
    }
    dspx_buf_t b;
    int rc = dspx_buf_alloc(k, &b, room + c->kv_size, "dspx-staging");
    if (rc) return rc;
    rc = dspx_attach(k, &b, DSPX_WIRE_ATTACH_STAGING, (uint32_t)c->kv_size);
    if (rc) {
        dspx_buf_release(&b);
        return rc;
    }
    c->staging = b;
    return 0;
}

static int stage(c7x_client_t *c, const void *data, size_t size, const char *what) {
    if (!data && size) return dspx_fail(&c->conn, -EINVAL, 0, "%s: NULL data", what);
    if (size == 0) return dspx_fail(&c->conn, -EINVAL, 0, "%s: empty", what);
    if (size > UINT32_MAX)
        return dspx_fail(&c->conn, -EFBIG, 0, "%s of %zu bytes: the protocol's size field is 32-bit", what, size);
    if (!c->kv_size && c->staging.fd < 0) c->kv_size = c->opts.kv_size;
    int rc = ensure_staging(c, size);
    if (rc) return rc;
    dspx_buf_sync(&c->conn, &c->staging, DSPX_WIRE_SYNC_START | DSPX_WIRE_SYNC_WRITE);
    memcpy(c->staging.host, data, size);
    dspx_buf_sync(&c->conn, &c->staging, DSPX_WIRE_SYNC_END | DSPX_WIRE_SYNC_WRITE);
    return 0;
}

static int read_file(dspx_conn_t *k, const char *path, void **data, size_t *size) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return dspx_fail(k, -errno, 0, "cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return dspx_fail(k, -EINVAL, 0, "%s is not a regular file", path);
    }
    size_t n = (size_t)st.st_size, got = 0;
    uint8_t *p = malloc(n ? n : 1);
    if (!p) {
        close(fd);
        return dspx_fail(k, -ENOMEM, 0, "out of host memory reading %s", path);
    }
    while (got < n) {
        ssize_t r = read(fd, p + got, n - got);
        if (r <= 0) {
            int e = r < 0 ? errno : EIO;
            close(fd);
            free(p);
            return dspx_fail(k, -e, 0, "reading %s: %s", path, strerror(e));
        }
        got += (size_t)r;
    }
    close(fd);
    *data = p;
    *size = n;
    return 0;
}

/* ------------------------------------------------------------------ io capacity */

static size_t capacity(const dspx_buf_t *b) { return b->fd >= 0 ? b->size : 0; }
DSPX_API size_t c7x_client_input_capacity(const c7x_client_t *c) { return c ? capacity(&c->input_buf) : 0; }
DSPX_API size_t c7x_client_output_capacity(const c7x_client_t *c) { return c ? capacity(&c->output_buf) : 0; }
DSPX_API size_t c7x_client_get_input_data_offset(const c7x_client_t *c) { return c ? c->input_data_offset : 0; }
DSPX_API int c7x_client_io_locked(const c7x_client_t *c) { return c ? c->io_locked : 0; }

static int grow(c7x_client_t *c, int input, size_t want, uint32_t num_inputs) {
    dspx_buf_t *cur = input ? &c->input_buf : &c->output_buf;
    if (want <= capacity(cur)) return 0;
    /* new first, then the old one goes: the new buffer never overlaps it */
    dspx_buf_t nb;
    int rc = dspx_buf_new(&c->conn, &nb, want, input ? "dspx-input" : "dspx-output");
    if (rc) return rc;
    if (cur->fd >= 0) {
        dspx_detach(&c->conn, cur);
        if (input && c->io_locked) {  /* keep create_input tensors readable: they are copied from now on */
            if (c->n_retired == RETIRED_MAX) {
                dspx_buf_release(&c->retired[0]);
                memmove(c->retired, c->retired + 1, sizeof c->retired[0] * (RETIRED_MAX - 1));
                c->n_retired--;
            }
            c->retired[c->n_retired++] = *cur;
        } else {
            dspx_buf_release(cur);
        }
    }
    *cur = nb;
    if (input) {
        size_t region = (size_t)dspx_align(80ull * num_inputs, 64);
        if (region > c->input_data_offset) c->input_data_offset = region;
        c->create_input_end = c->input_data_offset;
    }
    return 0;
}

static void declare_io(c7x_client_t *c, uint64_t in, uint64_t out, uint32_t num_inputs) {
    char why[2][DSPX_ERR_LEN];
    int shortfall = 0;
    for (int side = 0; side < 2; side++) {
        uint64_t want = side == 0 ? in : out;
        why[side][0] = 0;
        int rc = want > SIZE_MAX ? -EFBIG : grow(c, side == 0, (size_t)want, num_inputs);
        if (rc) {
            snprintf(why[side], sizeof why[side], "%s declared %llu bytes, allocated %zu (%s)",
                     side == 0 ? "input" : "output", (unsigned long long)want,
                     capacity(side == 0 ? &c->input_buf : &c->output_buf),
                     c->conn.last_status ? dspx_wire_status_name(c->conn.last_status) : strerror(-rc));
            shortfall = 1;
        }
    }
    dspx_clear_error(&c->conn);
    if (shortfall) {
        /* Advisory: the load succeeds; the caller declares its real figure. */
        fprintf(stderr, "libdspx: warning: io declaration could not be met: %s%s%s — call "
                        "c7x_client_reserve_io() with the real figures before the first inference\n",
                why[0], why[0][0] && why[1][0] ? "; " : "", why[1]);
    }
}

DSPX_API int c7x_client_reserve_io(c7x_client_t *c, size_t input_bytes, size_t output_bytes) {
    BEGIN(c);
    if (c->io_locked)
        return dspx_fail(&c->conn, -EPERM, 0,
                         "reserve_io(%zu, %zu) refused: capacity was locked at input %zu / output %zu bytes by its "
                         "first successful use",
                         input_bytes, output_bytes, capacity(&c->input_buf), capacity(&c->output_buf));
    int rc = grow(c, 1, input_bytes, c->declared_inputs);
    if (rc) return rc;
    return grow(c, 0, output_bytes, 0);
}

/* ------------------------------------------------------------------ modules */

DSPX_API int c7x_client_dyn_load(c7x_client_t *c, const void *elf, size_t size, c7x_module_info_t *info) {
    BEGIN(c);
    int rc = stage(c, elf, size, "module");
    if (rc) return rc;
    dspx_wire_dyn_load_t m;
    memset(&m, 0, sizeof m);
    m.hdr.type = DSPX_MSG_DYN_LOAD;
    m.elf_size = (uint32_t)size;
    dspx_wire_dyn_load_resp_t r;
    rc = dspx_request(&c->conn, &m, sizeof m, -1, &r, sizeof r, NULL, 0);
    if (rc) {
        c->conn.oom_requested = r.oom_requested;
        c->conn.oom_free = r.oom_free;
        c->conn.oom_total = r.oom_total;
        return rc;
    }
    if (info) {
        info->handle = r.module_handle;
        info->text_size = r.text_size;
        info->data_size = r.data_size;
        info->io_input_bytes = r.io_input_bytes;
        info->io_output_bytes = r.io_output_bytes;
        info->io_num_inputs = r.io_num_inputs;
        info->io_num_outputs = r.io_num_outputs;
        info->io_flags = r.io_flags;
    }
    if (r.io_input_bytes || r.io_output_bytes) {
        c->declared_inputs = r.io_num_inputs;
        declare_io(c, r.io_input_bytes, r.io_output_bytes, r.io_num_inputs);
    }
    return 0;
}

DSPX_API int c7x_client_dyn_load_file(c7x_client_t *c, const char *path, c7x_module_info_t *info) {
    BEGIN(c);
    void *d;
    size_t n;
    int rc = read_file(&c->conn, path, &d, &n);
    if (rc) return rc;
    rc = c7x_client_dyn_load(c, d, n, info);
    free(d);
    return rc;
}

DSPX_API int c7x_client_dyn_unload(c7x_client_t *c, uint32_t handle) {
    BEGIN(c);
    dspx_wire_dyn_unload_t m;
    memset(&m, 0, sizeof m);
    m.hdr.type = DSPX_MSG_DYN_UNLOAD;
    m.module_handle = handle;
    dspx_wire_dyn_unload_resp_t r;
    return dspx_request(&c->conn, &m, sizeof m, -1, &r, sizeof r, NULL, 0);
}

DSPX_API int c7x_client_model_load(c7x_client_t *c, const void *weights, size_t size, uint32_t *model_id,
                                   uint32_t *num_constants) {
    BEGIN(c);
    int rc = stage(c, weights, size, "weights");
    if (rc) return rc;
    dspx_wire_model_load_t m;
    memset(&m, 0, sizeof m);
    m.hdr.type = DSPX_MSG_MODEL_LOAD;
    m.weights_size = (uint32_t)size;
    dspx_wire_model_load_resp_t r;
    rc = dspx_request(&c->conn, &m, sizeof m, -1, &r, sizeof r, NULL, 0);
    if (rc) {
        c->conn.oom_requested = r.oom_requested;
        c->conn.oom_free = r.oom_free;
        c->conn.oom_total = r.oom_total;
        return rc;
    }
    if (model_id) *model_id = r.model_id;
    if (num_constants) *num_constants = r.num_constants;
    return 0;
}

DSPX_API int c7x_client_model_load_file(c7x_client_t *c, const char *path, uint32_t *model_id,
                                        uint32_t *num_constants) {
    BEGIN(c);
    void *d;
    size_t n;
    int rc = read_file(&c->conn, path, &d, &n);
    if (rc) return rc;
    rc = c7x_client_model_load(c, d, n, model_id, num_constants);
    free(d);
    return rc;
}

DSPX_API int c7x_client_model_unload(c7x_client_t *c, uint32_t model_id) {
    BEGIN(c);
    dspx_wire_model_unload_t m;
    memset(&m, 0, sizeof m);
    m.hdr.type = DSPX_MSG_MODEL_UNLOAD;
    m.model_id = model_id;
    dspx_wire_model_unload_resp_t r;
    return dspx_request(&c->conn, &m, sizeof m, -1, &r, sizeof r, NULL, 0);
}

/* ------------------------------------------------------------------ tensors */

static int dtype_ok(int32_t code, int32_t bits) {
    if (code == DSPX_WIRE_DTYPE_INT || code == DSPX_WIRE_DTYPE_UINT)
        return bits == 8 || bits == 16 || bits == 32 || bits == 64;
    if (code == DSPX_WIRE_DTYPE_FLOAT) return bits == 16 || bits == 32 || bits == 64;
    return 0;
}

DSPX_API int c7x_client_create_input(c7x_client_t *c, int32_t ndim, const int64_t *shape, int32_t dtype_code,
                                     int32_t dtype_bits, c7x_tensor_desc_t *out) {
    BEGIN(c);
    if (!out || ndim < 0 || ndim > C7X_MAX_NDIM || (ndim && !shape))
        return dspx_fail(&c->conn, -EINVAL, 0, "create_input: ndim %d outside 0..%d or no shape", ndim, C7X_MAX_NDIM);
    if (!dtype_ok(dtype_code, dtype_bits))
        return dspx_fail(&c->conn, -EINVAL, 0, "create_input: unsupported dtype (code %d, bits %d)", dtype_code,
                         dtype_bits);
    int64_t nbytes = dspx_shape_bytes(ndim, shape, dtype_bits);
    if (nbytes < 0) return dspx_fail(&c->conn, -EINVAL, 0, "create_input: bad shape");
    if (c->input_buf.fd < 0)
        return dspx_fail(&c->conn, -EFBIG, 0,
                         "create_input needs %lld bytes but input_buf holds 0 (EFBIG); call "
                         "c7x_client_reserve_io() before the first inference",
                         (long long)nbytes);
    size_t off = (size_t)dspx_align(c->create_input_end, 64);
    if ((uint64_t)nbytes > c->input_buf.size || off > c->input_buf.size - (size_t)nbytes)
        return dspx_fail(&c->conn, -EFBIG, 0, "create_input needs %llu bytes but input_buf holds %zu (EFBIG)",
                         (unsigned long long)(off + (uint64_t)nbytes), c->input_buf.size);
    memset(out, 0, sizeof *out);
    out->data = c->input_buf.host + off;
    out->data_size = (size_t)nbytes;
    out->ndim = ndim;
    out->dtype_code = dtype_code;
    out->dtype_bits = dtype_bits;
    for (int i = 0; i < ndim; i++) out->shape[i] = shape[i];
    c->create_input_end = off + (size_t)nbytes;
    c->io_locked = 1;
    return 0;
}

DSPX_API int c7x_client_kv_region(c7x_client_t *c, void **ptr, size_t *size) {
    BEGIN(c);
    if (c->staging.fd < 0) {
        c->kv_size = c->opts.kv_size;
        if (!c->kv_size) return dspx_fail(&c->conn, -EINVAL, 0, "this client was opened with kv_size 0");
        int rc = ensure_staging(c, 4096);
        if (rc) return rc;
    }
    if (!c->kv_size) return dspx_fail(&c->conn, -EINVAL, 0, "this client has no KV region");
    if (ptr) *ptr = c->staging.host + c->staging.size - c->kv_size;
    if (size) *size = c->kv_size;
    return 0;
}

/* ------------------------------------------------------------------ inference */

static int to_wire(c7x_client_t *c, const c7x_tensor_desc_t *d, uint64_t addr, dspx_wire_tensor_desc_t *w) {
    memset(w, 0, sizeof *w);
    w->data_addr = addr;
    w->data_size = d->data_size;
    w->ndim = d->ndim;
    w->dtype_code = d->dtype_code;
    w->dtype_bits = d->dtype_bits;
    int nd = d->ndim < 0 ? 0 : d->ndim > C7X_MAX_NDIM ? C7X_MAX_NDIM : d->ndim;
    for (int i = 0; i < nd; i++) w->shape[i] = d->shape[i];
    (void)c;
    return 0;
}

/* One output descriptor the device wrote, checked before a pointer is made of
 * it: a well-formed tensor (docs/protocol.md, "Tensor descriptor") wholly
 * inside output_buf or the KV region. */
static int from_wire(c7x_client_t *c, const dspx_wire_tensor_desc_t *w, c7x_tensor_desc_t *d) {
    memset(d, 0, sizeof *d);
    int64_t shape[C7X_MAX_NDIM];
    memcpy(shape, w->shape, sizeof shape); /* aligned: the wire struct is packed */
    if (w->ndim < 0 || w->ndim > C7X_MAX_NDIM || !dtype_ok(w->dtype_code, w->dtype_bits) ||
        (int64_t)w->data_size < 0 || dspx_shape_bytes(w->ndim, shape, w->dtype_bits) != (int64_t)w->data_size)
        return dspx_fail(&c->conn, -EPROTO, 0,
                         "output descriptor is not a tensor: ndim %d, dtype (code %d, bits %d), %llu bytes",
                         w->ndim, w->dtype_code, w->dtype_bits, (unsigned long long)w->data_size);
    const dspx_buf_t *ob = &c->output_buf;
    if (dspx_buf_contains(ob, w->data_addr, w->data_size)) {
        d->data = ob->host + (w->data_addr - ob->dsp_addr);
    } else if (c->kv_size && dspx_buf_contains(&c->staging, w->data_addr, w->data_size) &&
               w->data_addr - c->staging.dsp_addr >= c->staging.size - c->kv_size) {
        d->data = c->staging.host + (w->data_addr - c->staging.dsp_addr); /* KV-resident output */
    } else {
        return dspx_fail(&c->conn, -EPROTO, 0, "output descriptor 0x%llx+%llu is outside output_buf",
                         (unsigned long long)w->data_addr, (unsigned long long)w->data_size);
    }
    d->data_size = (size_t)w->data_size;
    d->ndim = w->ndim;
    d->dtype_code = w->dtype_code;
    d->dtype_bits = w->dtype_bits;
    for (int i = 0; i < C7X_MAX_NDIM; i++) d->shape[i] = shape[i];
    return 0;
}

/* The outputs of a successful INFER_RESP / INFER_LARGE_RESP of rlen bytes
 * (already checked against its type's size): the descriptors inline, or the
 * table in output_buf at descs_addr; every one through from_wire. */
static int decode_outputs(c7x_client_t *c, const uint8_t *resp, size_t rlen, c7x_tensor_desc_t *outputs,
                          uint32_t max_outputs) {
    dspx_conn_t *k = &c->conn;
    const dspx_buf_t *ob = &c->output_buf;
    dspx_wire_infer_resp_t r;
    memcpy(&r, resp, sizeof r);
    uint32_t nout = r.num_outputs;
    const uint8_t *descs = resp + sizeof r;
    if (r.descs_size) {
        if (!dspx_buf_contains(ob, r.descs_addr, r.descs_size) || r.descs_size < 80ull * nout)
            return dspx_fail(k, -EPROTO, 0, "output descriptor region 0x%llx+%u is outside output_buf",
                             (unsigned long long)r.descs_addr, r.descs_size);
        descs = ob->host + (r.descs_addr - ob->dsp_addr);
    } else if (rlen < sizeof r + 80ull * nout) {
        return dspx_fail(k, -EPROTO, 0, "INFER_RESP of %zu bytes holds fewer than %u descriptors", rlen, nout);
    }
    int rc = 0;
    dspx_buf_sync(k, &c->output_buf, DSPX_WIRE_SYNC_START | DSPX_WIRE_SYNC_READ);
    for (uint32_t i = 0; i < nout && i < max_outputs && !rc; i++) {
        dspx_wire_tensor_desc_t wd;
        memcpy(&wd, descs + 80u * i, sizeof wd);
        rc = from_wire(c, &wd, &outputs[i]);
    }
    dspx_buf_sync(k, &c->output_buf, DSPX_WIRE_SYNC_END | DSPX_WIRE_SYNC_READ);
    return rc;
}

DSPX_API int c7x_client_infer(c7x_client_t *c, uint32_t handle, uint32_t model_id, const c7x_tensor_desc_t *inputs,
                              uint32_t num_inputs, c7x_tensor_desc_t *outputs, uint32_t max_outputs, uint32_t flags,
                              c7x_infer_info_t *info) {
    BEGIN(c);
    dspx_conn_t *k = &c->conn;
    if (info) memset(info, 0, sizeof *info);
    if (num_inputs && !inputs) return dspx_fail(k, -EINVAL, 0, "infer: NULL inputs");
    if (max_outputs && !outputs) return dspx_fail(k, -EINVAL, 0, "infer: NULL outputs");
    if (num_inputs > 4096) return dspx_fail(k, -EINVAL, 0, "infer: %u inputs", num_inputs);
    if (c->input_buf.fd < 0 || c->output_buf.fd < 0) {
        uint64_t total = 0;
        for (uint32_t i = 0; i < num_inputs; i++) total += inputs[i].data_size;
        return dspx_fail(k, -EFBIG, 0,
                         "inference needs %llu bytes but input_buf holds %zu (EFBIG); the module declared no io "
                         "sizes: call c7x_client_reserve_io() before the first inference",
                         (unsigned long long)total, capacity(&c->input_buf));
    }
    dspx_buf_t *ib = &c->input_buf, *ob = &c->output_buf;
    size_t desc_region = (size_t)dspx_align(80ull * num_inputs, 64);
    if (desc_region > c->input_data_offset && c->create_input_end > c->input_data_offset)
        return dspx_fail(k, -EFBIG, 0, "descriptor region needs %zu bytes but input_buf reserves %zu (EFBIG)",
                         desc_region, c->input_data_offset);
    uint64_t pos = desc_region > c->create_input_end ? desc_region : c->create_input_end;
    uint64_t kv_lo = 0, kv_base = 0;
    if (c->kv_size && c->staging.fd >= 0) {
        kv_lo = c->staging.size - c->kv_size;
        kv_base = c->staging.dsp_addr + kv_lo;
    }
    /* Place every input first: nothing is staged when one does not fit. */
    uint64_t stack_off[16];
    uint64_t *off = num_inputs <= 16 ? stack_off : malloc(sizeof(uint64_t) * num_inputs);
    uint8_t stack_copy[16];
    uint8_t *copy = num_inputs <= 16 ? stack_copy : malloc(num_inputs);
    dspx_wire_tensor_desc_t stack_w[DSPX_WIRE_MAX_INLINE_INPUTS];
    dspx_wire_tensor_desc_t *w =
        num_inputs <= DSPX_WIRE_MAX_INLINE_INPUTS ? stack_w : malloc(sizeof *w * (num_inputs ? num_inputs : 1));
    int rc = 0;
    if (!off || !copy || !w) {
        rc = dspx_fail(k, -ENOMEM, 0, "out of host memory");
        goto out;
    }
    for (uint32_t i = 0; i < num_inputs; i++) {
        const c7x_tensor_desc_t *d = &inputs[i];
        if (d->data_size && !d->data) {
            rc = dspx_fail(k, -EINVAL, 0, "input %u: NULL data", i);
            goto out;
        }
        if (dspx_host_in(ib, d->data, d->data_size)) {
            off[i] = (uint64_t)((const uint8_t *)d->data - ib->host);
            copy[i] = 0;
            to_wire(c, d, ib->dsp_addr + off[i], &w[i]);
        } else if (kv_base && dspx_host_in(&c->staging, d->data, d->data_size) &&
                   (uint64_t)((const uint8_t *)d->data - c->staging.host) >= kv_lo) {
            copy[i] = 0; /* lives in the KV region */
            to_wire(c, d, c->staging.dsp_addr + (uint64_t)((const uint8_t *)d->data - c->staging.host), &w[i]);
        } else {
            /* saturating: a size that wrapped the sum would pass the capacity check below */
            off[i] = pos > UINT64_MAX - 63 ? UINT64_MAX : dspx_align(pos, 64);
            pos = d->data_size > UINT64_MAX - off[i] ? UINT64_MAX : off[i] + d->data_size;
            copy[i] = 1;
            to_wire(c, d, ib->dsp_addr + off[i], &w[i]);
        }
    }
    if (pos > ib->size) {
        rc = dspx_fail(k, -EFBIG, 0,
                       "inputs need %llu bytes but input_buf holds %zu (EFBIG); call c7x_client_reserve_io() "
                       "before the first inference",
                       (unsigned long long)pos, ib->size);
        goto out;
    }
    dspx_buf_sync(k, ib, DSPX_WIRE_SYNC_START | DSPX_WIRE_SYNC_WRITE);
    for (uint32_t i = 0; i < num_inputs; i++)
        if (copy[i] && inputs[i].data_size) memcpy(ib->host + off[i], inputs[i].data, inputs[i].data_size);
    union {
        dspx_wire_infer_t inf;
        dspx_wire_infer_large_t large;
        uint8_t b[DSPX_WIRE_MAX_MSG];
    } m;
    uint32_t mlen;
    memset(&m, 0, sizeof(dspx_wire_infer_large_t));
    if (num_inputs <= DSPX_WIRE_MAX_INLINE_INPUTS) {
        m.inf.hdr.type = DSPX_MSG_INFER;
        m.inf.module_handle = handle;
        m.inf.model_id = model_id;
        m.inf.num_inputs = num_inputs;
        m.inf.flags = flags;
        m.inf.input_dsp_addr = ib->dsp_addr;
        m.inf.input_size = ib->size;
        m.inf.result_dsp_addr = ob->dsp_addr;
        m.inf.result_size = ob->size;
        memcpy(m.b + sizeof m.inf, w, sizeof *w * num_inputs);
        mlen = (uint32_t)(sizeof m.inf + sizeof *w * num_inputs);
    } else {
        memcpy(ib->host, w, sizeof *w * num_inputs);
        m.large.hdr.type = DSPX_MSG_INFER_LARGE;
        m.large.module_handle = handle;
        m.large.model_id = model_id;
        m.large.num_inputs = num_inputs;
        m.large.flags = flags;
        m.large.descs_addr = ib->dsp_addr;
        m.large.descs_size = (uint32_t)(80u * num_inputs);
        m.large.input_dsp_addr = ib->dsp_addr;
        m.large.input_size = ib->size;
        m.large.result_dsp_addr = ob->dsp_addr;
        m.large.result_size = ob->size;
        mlen = sizeof m.large;
    }
    dspx_buf_sync(k, ib, DSPX_WIRE_SYNC_END | DSPX_WIRE_SYNC_WRITE);
    union {
        dspx_wire_infer_resp_t r;
        uint8_t b[DSPX_WIRE_MAX_MSG + 1];
    } r;
    size_t rlen = 0;
    rc = dspx_request(k, &m, mlen, -1, &r, sizeof r, &rlen, 0);
    /* INFER_RESP and INFER_LARGE_RESP share one body */
    if (info) {
        info->cycles = r.r.cycles;
        info->return_value = r.r.return_value;
        info->num_outputs = r.r.num_outputs;
        info->printf_size = r.r.printf_size;
        info->result_required = r.r.result_required;
        info->oom_requested = r.r.oom_requested;
        info->oom_free = r.r.oom_free;
        info->oom_total = r.r.oom_total;
    }
    if (rc) {
        k->result_required = r.r.result_required;
        k->oom_requested = r.r.oom_requested;
        k->oom_free = r.r.oom_free;
        k->oom_total = r.r.oom_total;
        if (r.r.hdr.status == DSPX_STATUS_ERR_SIZE && r.r.result_required) {
            size_t l = strlen(k->last_error);
            snprintf(k->last_error + l, sizeof k->last_error - l, " [result_required=%llu]",
                     (unsigned long long)r.r.result_required);
        }
        if (r.r.printf_size) dspx_printf_collect(k, r.r.printf_size);
        goto out;
    }
    dspx_printf_collect(k, r.r.printf_size);
    rc = decode_outputs(c, r.b, rlen, outputs, max_outputs);
    if (!rc) c->io_locked = 1;
out:
    if (off && off != stack_off) free(off);
    if (copy && copy != stack_copy) free(copy);
    if (w && w != stack_w) free(w);
    return rc;
}
