/* libdspx internals: one connection to the device, dmabufs, the printf
 * ring, errors.  Shared by the TI-shaped (c7x_client.c) and Horizon-shaped
 * (hb_ucp.c) front ends.  Wire layouts come only from dspx_wire.h, which is
 * generated from the Python protocol table. */
#ifndef DSPX_INTERNAL_H
#define DSPX_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "dspx_wire.h"

#define DSPX_API __attribute__((visibility("default")))
#define DSPX_ERR_LEN 768
#define DSPX_DEFAULT_TIMEOUT_MS 60000

typedef struct dspx_buf {
    int fd;           /* memfd, -1 when unused */
    uint8_t *host;    /* this process's mapping */
    size_t size;      /* page aligned */
    uint64_t dsp_addr; /* 0 when not attached */
    /* explicit sync (DMA_BUF_IOCTL_SYNC semantics): start/end pairs, counted */
    int syncing;
    uint64_t synced_read, synced_write;
    uint32_t sync_calls;
} dspx_buf_t;

typedef struct dspx_stash {
    struct dspx_stash *next;
    uint32_t seq;
    uint32_t len;
    uint8_t data[DSPX_WIRE_MAX_MSG];
} dspx_stash_t;

typedef struct dspx_conn {
    int fd;
    uint32_t next_seq;
    int timeout_ms;
    pthread_mutex_t lock;   /* socket receive + stash */
    dspx_stash_t *stash;    /* responses that arrived for other waiters: at most one per pending seq */
    /* seqs sent and not yet answered (their own lock: senders never take
     * `lock`, a waiter may sleep in recvmsg holding it).  A response to any
     * other seq, or a second one to a seq, is dropped (docs/protocol.md). */
    pthread_mutex_t pending_lock;
    uint32_t *pending;
    size_t n_pending, pending_cap;
    uint64_t dropped;       /* responses dropped so far */
    int waiters;            /* threads in dspx_wait */
    int rcvtimeo_set;       /* SO_RCVTIMEO = timeout_ms */
    int lost;
    char path[108];
    /* the last failure */
    int last_rc;
    int32_t last_status;
    char last_error[DSPX_ERR_LEN];
    uint64_t result_required;
    uint32_t oom_requested, oom_free, oom_total;
    uint32_t device_version;
    /* printf ring */
    dspx_buf_t printf_buf;
    uint32_t printf_read;
    char *printf_text;
    size_t printf_cap;
    int printf_to_stderr;
} dspx_conn_t;

/* errors */
int dspx_status_errno(int32_t status);
int dspx_fail(dspx_conn_t *c, int rc, int32_t status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void dspx_clear_error(dspx_conn_t *c);
const char *dspx_open_error(void);
int dspx_set_open_error(int rc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* connection */
int dspx_default_timeout_ms(void);
/* Where the socket is: the path passed, else $DSPX_SOCKET, else the per-user
 * default; a name in a shared directory (sticky, like /tmp) lives in its
 * dspx-<uid> subdirectory, as transport.socket_path places it. */
enum { DSPX_SOCKET_NAMED, DSPX_SOCKET_ENV, DSPX_SOCKET_DEFAULT };
int dspx_socket_path(const char *explicit_path, char *out, size_t cap, int *origin);
int dspx_conn_open(dspx_conn_t *c, const char *path, int timeout_ms);
/* PING + major version check, then the printf ring (printf_size 0: none) */
int dspx_conn_handshake(dspx_conn_t *c, size_t printf_size);
void dspx_conn_close(dspx_conn_t *c);
int dspx_send(dspx_conn_t *c, void *msg, uint32_t len, int fd, uint32_t *seq);
/* The response to seq (type must be expect_type, size right for it): copied
 * into resp (zero padded to cap); *len gets its datagram size.  Host-side
 * errors only.  seq is done after it, unless it timed out (wait again, or
 * dspx_forget it). */
int dspx_wait(dspx_conn_t *c, uint32_t seq, uint32_t expect_type, void *resp, size_t cap, size_t *len,
              int timeout_ms, const char *what);
/* seq will not be waited for again: its response, when it comes, is dropped */
void dspx_forget(dspx_conn_t *c, uint32_t seq);
/* A datagram of n bytes as the device sent it: at most MAX_MSG, a whole
 * header, its len field = n.  0, or -EPROTO with the error set. */
int dspx_check_frame(dspx_conn_t *c, const uint8_t *buf, size_t n);
/* A datagram of n bytes is the right size for its type (a bare 16-byte
 * header is one too when it carries a failure).  0, or -EPROTO with the error set. */
int dspx_check_size(dspx_conn_t *c, const void *msg, size_t n);
/* send + wait + status check (device failure -> errno, text from GET_ERROR) */
int dspx_request(dspx_conn_t *c, void *msg, uint32_t len, int fd, void *resp, size_t cap, size_t *rlen,
                 int timeout_ms);
/* A response's status turned into a return code (fetches the device text). */
int dspx_check(dspx_conn_t *c, const void *resp, size_t rlen, const char *what);

/* dmabufs */
void dspx_buf_init(dspx_buf_t *b);
int dspx_buf_alloc(dspx_conn_t *c, dspx_buf_t *b, size_t size, const char *name);
void dspx_buf_release(dspx_buf_t *b);   /* unmap + close (device side untouched) */
int dspx_buf_sync(dspx_conn_t *c, dspx_buf_t *b, uint32_t flags);
int dspx_attach(dspx_conn_t *c, dspx_buf_t *b, uint32_t flags, uint32_t kv_size);
int dspx_detach(dspx_conn_t *c, dspx_buf_t *b);
/* alloc + attach */
int dspx_buf_new(dspx_conn_t *c, dspx_buf_t *b, size_t size, const char *name);
static inline int dspx_buf_contains(const dspx_buf_t *b, uint64_t addr, uint64_t size) {
    return b->fd >= 0 && b->dsp_addr && addr >= b->dsp_addr && size <= b->size &&
           addr - b->dsp_addr <= b->size - size;
}
static inline int dspx_host_in(const dspx_buf_t *b, const void *p, size_t size) {
    uintptr_t a = (uintptr_t)p, base = (uintptr_t)b->host;
    return b->fd >= 0 && b->host && a >= base && size <= b->size && a - base <= b->size - size;
}

/* printf ring: text printed since the last read (into c->printf_text) */
const char *dspx_printf_collect(dspx_conn_t *c, uint32_t nbytes);

static inline uint64_t dspx_align(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

#endif
