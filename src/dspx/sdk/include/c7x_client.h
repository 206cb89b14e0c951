/* c7x_client.h — TI-shaped C client of the dspx device (libdspx).
 *
 * One c7x_client_t is one connection to a device listening on an AF_UNIX
 * SOCK_SEQPACKET socket ($DSPX_SOCKET, else ${XDG_RUNTIME_DIR:-/tmp}/dspx-<uid>/dsp0.sock).
 * libdspx starts no device of its own: run `dspx serve`, or any `dspx` command
 * (it starts the per-user background device, docs/device.md), first.
 *
 * Every function returns 0 on success or a negative errno value; the
 * device's status (DSPX_STATUS_*) and the device's text for the failure
 * are then in c7x_client_last_status() / c7x_client_last_error().
 * See docs/c-api.md for each function's errors and the buffer lifetimes.
 * A client is not meant to be used from several threads at once.
 */
#ifndef C7X_CLIENT_H
#define C7X_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "dspx_wire.h" /* generated from the protocol table at build time */

#ifdef __cplusplus
extern "C" {
#endif

/* The seed's c7x_tensor_desc_t: a host-side descriptor (host pointer, not a
 * DSP address; the library translates).  80 bytes, like the wire's. */
typedef struct c7x_tensor_desc {
    void *data;          /* host pointer; outputs point into output_buf */
    size_t data_size;    /* bytes = product(shape) * dtype_bits / 8 */
    int32_t ndim;        /* 0..6 */
    int32_t dtype_code;  /* DLPack: 0 int, 1 uint, 2 float */
    int32_t dtype_bits;
    int32_t _pad;
    int64_t shape[6];
} c7x_tensor_desc_t;

#ifdef __cplusplus
static_assert(sizeof(c7x_tensor_desc_t) == 80, "c7x_tensor_desc_t must be 80 bytes");
static_assert(sizeof(c7x_tensor_desc_t) == DSPX_WIRE_TENSOR_DESC_SIZE, "same size as the wire descriptor");
#else
_Static_assert(sizeof(c7x_tensor_desc_t) == 80, "c7x_tensor_desc_t must be 80 bytes");
_Static_assert(sizeof(c7x_tensor_desc_t) == DSPX_WIRE_TENSOR_DESC_SIZE, "same size as the wire descriptor");
#endif

#define C7X_MAX_NDIM ((int)DSPX_WIRE_MAX_NDIM)
#define C7X_INFER_FLAG_KV_RESIDENT DSPX_WIRE_FLAG_KV_RESIDENT
#define C7X_INFER_REPEAT(n) ((uint32_t)(n) & DSPX_WIRE_REPEAT_MASK)
#define C7X_PROTOCOL_VERSION DSPX_WIRE_VERSION

typedef struct c7x_client c7x_client_t;

typedef struct c7x_client_opts {
    const char *socket_path; /* NULL: $DSPX_SOCKET, else the per-user default */
    int timeout_ms;          /* every wait; 0: $DSPX_TIMEOUT_MS, else 60000 */
    size_t staging_size;     /* minimum staging area; 0: sized to the first load */
    size_t kv_size;          /* KV region at staging's end; (size_t)-1: default 12 MiB, 0: none */
    size_t printf_size;      /* printf ring; (size_t)-1: default 64 KiB, 0: none */
    int printf_to_stderr;    /* 1 (default when opened by c7x_client_open): echo DSP printf to stderr */
} c7x_client_opts_t;

#define C7X_CLIENT_OPTS_INIT {NULL, 0, 0, (size_t)-1, (size_t)-1, 1}

typedef struct c7x_module_info {
    uint32_t handle;
    uint32_t text_size;
    uint32_t data_size;
    uint64_t io_input_bytes;
    uint64_t io_output_bytes;
    uint32_t io_num_inputs;
    uint32_t io_num_outputs;
    uint32_t io_flags;
} c7x_module_info_t;

typedef struct c7x_status {
    uint32_t version;
    uint32_t uptime_ms;
    uint32_t jobs_completed;
    uint32_t jobs_failed;
} c7x_status_t;

typedef struct c7x_pool_status {
    uint64_t ddr_total, ddr_used, ddr_peak;
    uint64_t carveout_total, carveout_used;
    uint32_t l2_total, l2_used;
    uint32_t connections, modules, cores, op_count;
    uint64_t rss_bytes;
} c7x_pool_status_t;

typedef struct c7x_infer_info {
    uint64_t cycles;          /* device cycles of the entry call (median run with repeat) */
    int32_t return_value;
    uint32_t num_outputs;     /* outputs the module produced (may exceed max_outputs) */
    uint32_t printf_size;     /* bytes the call printed (text: c7x_client_printf_text) */
    uint64_t result_required; /* with -ENOSPC (ERR_SIZE): the output capacity that would fit */
    uint32_t oom_requested, oom_free, oom_total;
} c7x_infer_info_t;

/* ---- open / close */
int c7x_client_open(c7x_client_t **out, const char *socket_path);
int c7x_client_open_ex(c7x_client_t **out, const c7x_client_opts_t *opts);
void c7x_client_close(c7x_client_t *c);

/* ---- basics */
int c7x_client_ping(c7x_client_t *c, uint32_t *version, uint32_t *uptime_ms);
int c7x_client_status(c7x_client_t *c, c7x_status_t *out);
int c7x_client_pool_status(c7x_client_t *c, c7x_pool_status_t *out);
uint32_t c7x_client_device_version(const c7x_client_t *c);

/* ---- modules and weights (staged through the staging buffer) */
int c7x_client_dyn_load(c7x_client_t *c, const void *elf, size_t size, c7x_module_info_t *info);
int c7x_client_dyn_load_file(c7x_client_t *c, const char *path, c7x_module_info_t *info);
int c7x_client_dyn_unload(c7x_client_t *c, uint32_t handle);
int c7x_client_model_load(c7x_client_t *c, const void *weights, size_t size, uint32_t *model_id,
                          uint32_t *num_constants);
int c7x_client_model_load_file(c7x_client_t *c, const char *path, uint32_t *model_id, uint32_t *num_constants);
int c7x_client_model_unload(c7x_client_t *c, uint32_t model_id);

/* ---- io capacity (docs/protocol.md, "Capacity") */
int c7x_client_reserve_io(c7x_client_t *c, size_t input_bytes, size_t output_bytes);
size_t c7x_client_get_input_data_offset(const c7x_client_t *c);
size_t c7x_client_input_capacity(const c7x_client_t *c);
size_t c7x_client_output_capacity(const c7x_client_t *c);
int c7x_client_io_locked(const c7x_client_t *c);
/* A tensor inside input_buf (after the descriptor region): passing it to the
 * next infer skips the copy.  Locks capacity. */
int c7x_client_create_input(c7x_client_t *c, int32_t ndim, const int64_t *shape, int32_t dtype_code,
                            int32_t dtype_bits, c7x_tensor_desc_t *out);
/* The connection's KV region (at the end of staging; attached on demand). */
int c7x_client_kv_region(c7x_client_t *c, void **ptr, size_t *size);

/* ---- inference
 * inputs: host descriptors (data anywhere: copied once into input_buf, or
 * already inside it / inside the KV region: passed in place).  More than
 * DSPX_WIRE_MAX_INLINE_INPUTS inputs travel as INFER_LARGE.
 * outputs: filled with pointers into output_buf, valid until the next
 * c7x_client_infer or c7x_client_close.
 * flags: C7X_INFER_REPEAT(n) | C7X_INFER_FLAG_KV_RESIDENT.  info may be NULL. */
int c7x_client_infer(c7x_client_t *c, uint32_t handle, uint32_t model_id, const c7x_tensor_desc_t *inputs,
                     uint32_t num_inputs, c7x_tensor_desc_t *outputs, uint32_t max_outputs, uint32_t flags,
                     c7x_infer_info_t *info);
/* Text the device printed during the last call (NUL-terminated; valid until the next call). */
const char *c7x_client_printf_text(const c7x_client_t *c);

/* ---- errors */
const char *c7x_client_last_error(const c7x_client_t *c);  /* "" when none */
int32_t c7x_client_last_status(const c7x_client_t *c);     /* DSPX_STATUS_* of the last failure, 0 if host-side */
uint64_t c7x_client_result_required(const c7x_client_t *c);
/* after -ENOMEM from a load (ERR_NOMEM): requested / free / total bytes of the DDR pool */
void c7x_client_last_oom(const c7x_client_t *c, uint32_t *requested, uint32_t *free_bytes, uint32_t *total);
const char *c7x_status_name(int32_t status);               /* "ERR_SIZE"; NULL if unknown */
/* Text of the last failed open (no client to ask); thread-local. */
const char *c7x_client_open_error(void);

#ifdef __cplusplus
}
#endif

#endif /* C7X_CLIENT_H */
