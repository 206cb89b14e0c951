/* libdspx: the connection (SOCK_SEQPACKET, SCM_RIGHTS), request/response
 * matching by seq with a stash for other waiters, every wait bounded,
 * status -> errno with the device's text (GET_ERROR), dmabufs (sealed
 * memfds) and the printf ring.  Mirrors src/dspx/host/client.py. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "dspx_internal.h"

/* ------------------------------------------------------------------ errors */

int dspx_status_errno(int32_t status) {
    switch (status) {
    case DSPX_STATUS_SUCCESS: return 0;
    case DSPX_STATUS_ERR_GENERIC: return -EIO;
    case DSPX_STATUS_ERR_INVALID: return -EINVAL;
    case DSPX_STATUS_ERR_NOMEM: return -ENOMEM;
    case DSPX_STATUS_ERR_BUSY: return -EBUSY;
    case DSPX_STATUS_ERR_TIMEOUT: return -ETIME;
    case DSPX_STATUS_ERR_ADDR: return -EFAULT;
    case DSPX_STATUS_ERR_SIZE: return -ENOSPC;
    case DSPX_STATUS_ERR_OP: return -EOPNOTSUPP;
    case DSPX_STATUS_ERR_LOAD: return -ENOEXEC;
    case DSPX_STATUS_ERR_SYMBOL: return -ENOENT;
    case DSPX_STATUS_ERR_CALL: return -EREMOTEIO;
    case DSPX_STATUS_ERR_HANDLE: return -EBADF;
    case DSPX_STATUS_ERR_WEIGHTS: return -EBADMSG;
    case DSPX_STATUS_ERR_TENSOR: return -EDOM;
    default: return -EPROTO;
    }
}

static void vset(char *dst, size_t cap, const char *fmt, va_list ap) {
    vsnprintf(dst, cap, fmt, ap);
}

int dspx_fail(dspx_conn_t *c, int rc, int32_t status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vset(c->last_error, sizeof c->last_error, fmt, ap);
    va_end(ap);
    c->last_rc = rc;
    c->last_status = status;
    return rc;
}

void dspx_clear_error(dspx_conn_t *c) {
    c->last_rc = 0;
    c->last_status = 0;
    c->last_error[0] = 0;
    c->result_required = 0;
    c->oom_requested = c->oom_free = c->oom_total = 0;
}

static __thread char open_error[DSPX_ERR_LEN];

const char *dspx_open_error(void) { return open_error; }

int dspx_set_open_error(int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vset(open_error, sizeof open_error, fmt, ap);
    va_end(ap);
    return rc;
}

/* ------------------------------------------------------------------ time */

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int dspx_default_timeout_ms(void) {
    const char *e = getenv("DSPX_TIMEOUT_MS");
    if (e && *e) {
        long v = strtol(e, NULL, 10);
        if (v > 0 && v < 86400000L) return (int)v;
    }
    return DSPX_DEFAULT_TIMEOUT_MS;
}

/* ------------------------------------------------------------------ socket */

/* A directory others may write to, sticky like /tmp: a socket named in it
 * lives in its private subdirectory dspx-<uid> (transport.socket_path). */
static int shared_dir(const char *dir) {
    struct stat st;
    return stat(dir, &st) == 0 && S_ISDIR(st.st_mode) && (st.st_mode & S_ISVTX) && (st.st_mode & 022);
}

int dspx_socket_path(const char *explicit_path, char *out, size_t cap, int *origin) {
    const char *p = explicit_path && *explicit_path ? explicit_path : getenv("DSPX_SOCKET");
    int n;
    *origin = explicit_path && *explicit_path ? DSPX_SOCKET_NAMED : p && *p ? DSPX_SOCKET_ENV : DSPX_SOCKET_DEFAULT;
    if (p && *p) {
        const char *slash = strrchr(p, '/');
        char dir[PATH_MAX];
        int dn = slash ? snprintf(dir, sizeof dir, "%.*s", slash == p ? 1 : (int)(slash - p), p)
                       : snprintf(dir, sizeof dir, ".");
        if (dn > 0 && (size_t)dn < sizeof dir && shared_dir(dir))
            n = slash ? snprintf(out, cap, "%.*s/dspx-%u/%s", (int)(slash - p), p, (unsigned)getuid(), slash + 1)
                      : snprintf(out, cap, "dspx-%u/%s", (unsigned)getuid(), p);
        else
            n = snprintf(out, cap, "%s", p);
    } else {
        const char *base = getenv("XDG_RUNTIME_DIR");
        if (!base || !*base) base = "/tmp";
        n = snprintf(out, cap, "%s/dspx-%u/dsp0.sock", base, (unsigned)getuid());
    }
    if (n < 0 || (size_t)n >= cap) return -ENAMETOOLONG;
    return 0;
}

/* Would `dspx serve --socket PATH` serve there?  transport.serve_refusal's
 * rules: each directory from / down to the socket's is ours or root's and
 * nobody else may write to it (a sticky one only above the socket's own),
 * the socket's own is ours, a missing one would be created, an existing
 * file must be a socket.  A symlink on the way (which transport follows
 * only where it is safe) counts as a refusal here, so a command this
 * suggests is always one serve accepts.  0, or -1 with the reason. */
static int serve_refusal(const char *path, char *why, size_t cap) {
    char full[PATH_MAX], cwd[PATH_MAX];
    int n = path[0] == '/' ? snprintf(full, sizeof full, "%s", path)
                           : snprintf(full, sizeof full, "%s/%s", getcwd(cwd, sizeof cwd) ? cwd : ".", path);
    if (n < 0 || (size_t)n >= sizeof full) return snprintf(why, cap, "the path is too long"), -1;
    size_t dlen = (size_t)(strrchr(full, '/') - full); /* the socket's directory: full[0, dlen), "/" if 0 */
    struct stat st;
    uid_t uid = getuid();
    for (size_t i = 0; i <= dlen; i++) {
        if (i && full[i] != '/') continue;
        char dir[PATH_MAX];
        snprintf(dir, sizeof dir, "%.*s", i ? (int)i : 1, full); /* "/", "/a", "/a/b", ... */
        int final = i == dlen;
        if (lstat(dir, &st) != 0) break; /* missing: serve creates it and what is below */
        const char *bad = NULL;
        if (S_ISLNK(st.st_mode)) bad = "is a symlink";
        else if (!S_ISDIR(st.st_mode)) bad = "is not a directory";
        else if (st.st_uid != uid && (final || st.st_uid != 0)) bad = "is owned by another user";
        else if ((st.st_mode & 022) && (final || !(st.st_mode & S_ISVTX))) bad = "can be written by others";
        if (bad) return snprintf(why, cap, "%.200s %s", dir, bad), -1;
    }
    if (lstat(full, &st) == 0 && !S_ISSOCK(st.st_mode))
        return snprintf(why, cap, "%.200s exists and is not a socket", full), -1;
    return 0;
}

/* No device on c->path: what to run, each command one that works. */
static int no_device(dspx_conn_t *c, int origin, int e) {
    char why[300], alt[sizeof c->path], start[600];
    const char *slash = strrchr(c->path, '/');
    if (serve_refusal(c->path, why, sizeof why) == 0) {
        snprintf(start, sizeof start, origin == DSPX_SOCKET_DEFAULT ? "start one with `dspx serve`"
                 : "start one with `dspx serve --socket %s`", c->path);
    } else {
        const char *base = getenv("XDG_RUNTIME_DIR");
        int n = snprintf(alt, sizeof alt, "%s/dspx-%u/%s", base && *base ? base : "/tmp", (unsigned)getuid(),
                         slash ? slash + 1 : c->path);
        char ignored[300];
        if (n < 0 || (size_t)n >= sizeof alt || origin == DSPX_SOCKET_DEFAULT ||
            serve_refusal(alt, ignored, sizeof ignored) != 0)
            snprintf(alt, sizeof alt, "\"$(mktemp -d)/dsp0.sock\"");
        snprintf(start, sizeof start, "a device cannot serve there (%s): start one with `dspx serve --socket %s` "
                 "and connect to that socket", why, alt);
    }
    return dspx_set_open_error(-ECONNREFUSED, "no dspx device is listening on %s (%s): libdspx starts no device of "
                               "its own — %s (%s)", c->path, strerror(e), start,
                               origin == DSPX_SOCKET_NAMED ? "or pass the socket of a running one"
                                                           : "or set DSPX_SOCKET to the socket of a running one");
}

int dspx_conn_open(dspx_conn_t *c, const char *path, int timeout_ms) {
    memset(c, 0, sizeof *c);
    c->fd = -1;
    c->next_seq = 1;
    c->timeout_ms = timeout_ms > 0 ? timeout_ms : dspx_default_timeout_ms();
    c->printf_to_stderr = 1;
    dspx_buf_init(&c->printf_buf);
    pthread_mutex_init(&c->lock, NULL);
    pthread_mutex_init(&c->pending_lock, NULL);
    int origin;
    int rc = dspx_socket_path(path, c->path, sizeof c->path, &origin);
    if (rc) return dspx_set_open_error(rc, "socket path too long (at most %zu bytes)", sizeof c->path - 1);
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) return dspx_set_open_error(-errno, "socket(AF_UNIX, SOCK_SEQPACKET): %s", strerror(errno));
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, c->path, strlen(c->path) + 1);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        int e = errno;
        close(fd);
        if (e == ENOENT || e == ECONNREFUSED) return no_device(c, origin, e);
        return dspx_set_open_error(-e, "cannot connect to device socket %s: %s", c->path, strerror(e));
    }
    struct timeval tv = {c->timeout_ms / 1000, (c->timeout_ms % 1000) * 1000};
    c->rcvtimeo_set = setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) == 0;
    c->fd = fd;
    return 0;
}

static void stash_free(dspx_conn_t *c) {
    while (c->stash) {
        dspx_stash_t *n = c->stash->next;
        free(c->stash);
        c->stash = n;
    }
}

void dspx_conn_close(dspx_conn_t *c) {
    /* Closing the channel makes the device free everything this connection
     * attached; our own mappings go after. */
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    dspx_buf_release(&c->printf_buf);
    free(c->printf_text);
    c->printf_text = NULL;
    stash_free(c);
    free(c->pending);
    c->pending = NULL;
    c->n_pending = c->pending_cap = 0;
    pthread_mutex_destroy(&c->lock);
    pthread_mutex_destroy(&c->pending_lock);
}

static int lost(dspx_conn_t *c) {
    c->lost = 1;
    return dspx_fail(c, -ECONNRESET, 0, "the device closed the connection (it exited or was killed)");
}

/* One datagram if one is ready (MSG_DONTWAIT).  Returns its length, 0 when
 * nothing is ready, or a negative errno. Received fds are closed. */
static int recv_one(dspx_conn_t *c, uint8_t *buf, size_t cap, int block) {
    struct iovec iov = {buf, cap};
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(4 * sizeof(int))];
    } cm;
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cm.b;
    mh.msg_controllen = sizeof cm.b;
    ssize_t n = recvmsg(c->fd, &mh, (block ? 0 : MSG_DONTWAIT) | MSG_CMSG_CLOEXEC);
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
        if (errno == ECONNRESET || errno == EPIPE) return lost(c);
        return dspx_fail(c, -errno, 0, "recvmsg: %s", strerror(errno));
    }
    for (struct cmsghdr *h = CMSG_FIRSTHDR(&mh); h; h = CMSG_NXTHDR(&mh, h)) {
        if (h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS) {
            int nfd = (int)((h->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < nfd; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(h) + i * sizeof(int), sizeof fd);
                close(fd);
            }
        }
    }
    if (n == 0) {
        struct pollfd p = {c->fd, POLLIN | POLLRDHUP, 0};
        if (poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP))) return lost(c);
        return dspx_fail(c, -EPROTO, 0, "empty datagram from the device");
    }
    if (mh.msg_flags & MSG_TRUNC) n = (ssize_t)cap + 1; /* only "too long" matters */
    int rc = dspx_check_frame(c, buf, (size_t)n);
    return rc ? rc : (int)n;
}

int dspx_check_frame(dspx_conn_t *c, const uint8_t *buf, size_t n) {
    if (n > DSPX_WIRE_MAX_MSG)
        return dspx_fail(c, -EPROTO, 0, "datagram from the device is longer than %d bytes", DSPX_WIRE_MAX_MSG);
    if (n < sizeof(dspx_wire_header_t))
        return dspx_fail(c, -EPROTO, 0, "datagram of %zu bytes is shorter than the header", n);
    dspx_wire_header_t h;
    memcpy(&h, buf, sizeof h);
    if (h.len != (uint32_t)n)
        return dspx_fail(c, -EPROTO, 0, "response len field %u != datagram size %zu", h.len, n);
    return 0;
}

/* ------------------------------------------------------------------ pending seqs */

static int pending_add(dspx_conn_t *c, uint32_t seq) {
    int rc = 0;
    pthread_mutex_lock(&c->pending_lock);
    if (c->n_pending == c->pending_cap) {
        size_t cap = c->pending_cap ? c->pending_cap * 2 : 16;
        uint32_t *p = realloc(c->pending, cap * sizeof *p);
        if (p) {
            c->pending = p;
            c->pending_cap = cap;
        } else {
            rc = -ENOMEM;
        }
    }
    if (!rc) c->pending[c->n_pending++] = seq;
    pthread_mutex_unlock(&c->pending_lock);
    return rc ? dspx_fail(c, rc, 0, "out of host memory sending a request") : 0;
}

static int pending_has(dspx_conn_t *c, uint32_t seq) {
    int found = 0;
    pthread_mutex_lock(&c->pending_lock);
    for (size_t i = 0; i < c->n_pending && !found; i++) found = c->pending[i] == seq;
    pthread_mutex_unlock(&c->pending_lock);
    return found;
}

static void pending_remove(dspx_conn_t *c, uint32_t seq) {
    pthread_mutex_lock(&c->pending_lock);
    for (size_t i = 0; i < c->n_pending; i++) {
        if (c->pending[i] == seq) {
            c->pending[i] = c->pending[--c->n_pending];
            break;
        }
    }
    pthread_mutex_unlock(&c->pending_lock);
}

void dspx_forget(dspx_conn_t *c, uint32_t seq) { pending_remove(c, seq); }

/* Keep a response for its waiter (call with c->lock held).  Only a seq still
 * pending is kept, once; the rest is dropped, and so are kept responses whose
 * seq was forgotten meanwhile: the stash never holds more than the pending seqs. */
static int stash_put(dspx_conn_t *c, const uint8_t *data, int n) {
    dspx_wire_header_t h;
    memcpy(&h, data, sizeof h);
    int keep = pending_has(c, h.seq);
    for (dspx_stash_t **p = &c->stash; *p;) {
        dspx_stash_t *s = *p;
        if (s->seq == h.seq) keep = 0; /* a duplicate */
        if (!pending_has(c, s->seq)) {
            *p = s->next;
            free(s);
            c->dropped++;
        } else {
            p = &s->next;
        }
    }
    if (!keep) {
        c->dropped++;
        return 0;
    }
    dspx_stash_t *s = malloc(sizeof *s);
    if (!s) return dspx_fail(c, -ENOMEM, 0, "out of host memory keeping a response");
    s->seq = h.seq;
    s->len = (uint32_t)n;
    memcpy(s->data, data, (size_t)n);
    s->next = c->stash;
    c->stash = s;
    return 0;
}

static dspx_stash_t *stash_take(dspx_conn_t *c, uint32_t seq) {
    for (dspx_stash_t **p = &c->stash; *p; p = &(*p)->next) {
        if ((*p)->seq == seq) {
            dspx_stash_t *s = *p;
            *p = s->next;
            return s;
        }
    }
    return NULL;
}

static int send_datagram(dspx_conn_t *c, void *msg, uint32_t len, int fd);

int dspx_send(dspx_conn_t *c, void *msg, uint32_t len, int fd, uint32_t *seq) {
    if (c->fd < 0) return dspx_fail(c, -EBADF, 0, "client is closed");
    if (c->lost) return lost(c);
    if (len < sizeof(dspx_wire_header_t) || len > DSPX_WIRE_MAX_MSG)
        return dspx_fail(c, -EMSGSIZE, 0, "message of %u bytes (limit %u)", len, DSPX_WIRE_MAX_MSG);
    dspx_wire_header_t *h = (dspx_wire_header_t *)msg;
    uint32_t s = __atomic_fetch_add(&c->next_seq, 1, __ATOMIC_RELAXED); /* never under the lock: a waiter may sleep in it */
    if (s == 0) s = __atomic_fetch_add(&c->next_seq, 1, __ATOMIC_RELAXED);
    h->seq = s;
    h->len = len;
    h->status = 0;
    int rc = pending_add(c, s); /* before it goes out: another thread may read the answer first */
    if (!rc) rc = send_datagram(c, msg, len, fd);
    if (rc) {
        pending_remove(c, s);
        return rc;
    }
    if (seq) *seq = s;
    return 0;
}

/* msg out on the socket (with fd when >= 0), its responses-to-others kept meanwhile */
static int send_datagram(dspx_conn_t *c, void *msg, uint32_t len, int fd) {
    const dspx_wire_header_t *h = (const dspx_wire_header_t *)msg;
    struct iovec iov = {msg, len};
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(int))];
    } cm;
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (fd >= 0) {
        memset(&cm, 0, sizeof cm);
        mh.msg_control = cm.b;
        mh.msg_controllen = sizeof cm.b;
        struct cmsghdr *ch = CMSG_FIRSTHDR(&mh);
        ch->cmsg_level = SOL_SOCKET;
        ch->cmsg_type = SCM_RIGHTS;
        ch->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(ch), &fd, sizeof fd);
    }
    int64_t deadline = now_ms() + c->timeout_ms;
    for (;;) {
        ssize_t n = sendmsg(c->fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n == (ssize_t)len) break;
        if (n >= 0) return dspx_fail(c, -EPROTO, 0, "short send (%zd of %u bytes)", n, len);
        if (errno == EINTR) continue;
        if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN) return lost(c);
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return dspx_fail(c, -errno, 0, "sendmsg: %s", strerror(errno));
        /* Flow control: the device stops reading a connection that leaves its
         * responses unread.  Take them now (kept for their waiters), retry. */
        int64_t left = deadline - now_ms();
        if (left <= 0)
            return dspx_fail(c, -ETIMEDOUT, 0, "could not send %s within %d ms: the device does not take requests",
                             dspx_wire_msg_name(h->type) ? dspx_wire_msg_name(h->type) : "request", c->timeout_ms);
        struct pollfd p = {c->fd, POLLIN | POLLOUT, 0};
        int pr = poll(&p, 1, (int)(left < 50 ? left : 50));
        if (pr > 0 && (p.revents & (POLLIN | POLLHUP))) {
            uint8_t buf[DSPX_WIRE_MAX_MSG + 1];
            pthread_mutex_lock(&c->lock);
            int r = recv_one(c, buf, sizeof buf, 0);
            if (r > 0) r = stash_put(c, buf, r);
            pthread_mutex_unlock(&c->lock);
            if (r < 0) return r;
        }
    }
    return 0;
}

static int wait_one(dspx_conn_t *c, uint32_t seq, uint8_t *buf, int tmo, const char *what);

int dspx_wait(dspx_conn_t *c, uint32_t seq, uint32_t expect_type, void *resp, size_t cap, size_t *len,
              int timeout_ms, const char *what) {
    uint8_t buf[DSPX_WIRE_MAX_MSG + 1];
    int tmo = timeout_ms > 0 ? timeout_ms : c->timeout_ms;
    __atomic_add_fetch(&c->waiters, 1, __ATOMIC_SEQ_CST);
    int n = wait_one(c, seq, buf, tmo, what);
    __atomic_sub_fetch(&c->waiters, 1, __ATOMIC_SEQ_CST);
    if (n != -ETIMEDOUT) pending_remove(c, seq); /* answered or failed: later answers are dropped */
    if (n < 0) return n;
    dspx_wire_header_t h;
    memcpy(&h, buf, sizeof h);
    if (h.type != expect_type)
        return dspx_fail(c, -EPROTO, h.status, "response type 0x%04x to %s, expected 0x%04x", h.type,
                         what ? what : "request", expect_type);
    int rc = dspx_check_size(c, buf, (size_t)n);
    if (rc) return rc;
    memset(resp, 0, cap);
    memcpy(resp, buf, (size_t)n < cap ? (size_t)n : cap);
    if (len) *len = (size_t)n;
    return 0;
}

int dspx_check_size(dspx_conn_t *c, const void *msg, size_t n) {
    dspx_wire_header_t h;
    memcpy(&h, msg, sizeof h);
    uint32_t unit = 0, fixed = dspx_wire_msg_size(h.type, &unit);
    if (!fixed) return dspx_fail(c, -EPROTO, 0, "message of unknown type 0x%04x", h.type);
    if (n == fixed || (unit && n > fixed && (n - fixed) % unit == 0)) return 0;
    if (h.status != DSPX_STATUS_SUCCESS && n == DSPX_WIRE_HEADER_SIZE) return 0; /* a bare failure */
    const char *name = dspx_wire_msg_name(h.type);
    return dspx_fail(c, -EPROTO, 0, "%s of %zu bytes: its size is %u%s", name ? name : "response", n, fixed,
                     unit == DSPX_WIRE_TENSOR_DESC_SIZE ? " + 80 per descriptor" : unit ? " + its payload" : "");
}

/* the datagram answering seq into buf: its length, or a negative errno */
static int wait_one(dspx_conn_t *c, uint32_t seq, uint8_t *buf, int tmo, const char *what) {
    int64_t deadline = now_ms() + tmo;
    int n = 0;
    /* Fast path: the only waiter, with the connection's own timeout, blocks
     * in recvmsg (SO_RCVTIMEO = that timeout) — one syscall, like a bare
     * ping-pong.  Otherwise poll in slices and never hold the lock asleep. */
    int fast = tmo == c->timeout_ms && c->rcvtimeo_set;
    struct timespec abs_deadline; /* for the lock: another waiter may sleep in recvmsg holding it */
    clock_gettime(CLOCK_REALTIME, &abs_deadline);
    abs_deadline.tv_sec += tmo / 1000;
    abs_deadline.tv_nsec += (long)(tmo % 1000) * 1000000L;
    if (abs_deadline.tv_nsec >= 1000000000L) {
        abs_deadline.tv_sec++;
        abs_deadline.tv_nsec -= 1000000000L;
    }
    for (;;) {
        int lr = pthread_mutex_timedlock(&c->lock, &abs_deadline);
        if (lr == ETIMEDOUT)
            return dspx_fail(c, -ETIMEDOUT, 0, "no response to %s within %d ms", what ? what : "request", tmo);
        dspx_stash_t *s = stash_take(c, seq);
        if (s) {
            pthread_mutex_unlock(&c->lock);
            n = (int)s->len;
            memcpy(buf, s->data, s->len);
            free(s);
            break;
        }
        if (c->fd < 0 || c->lost) {
            pthread_mutex_unlock(&c->lock);
            return c->fd < 0 ? dspx_fail(c, -EBADF, 0, "client is closed") : lost(c);
        }
        int block = fast && __atomic_load_n(&c->waiters, __ATOMIC_SEQ_CST) == 1;
        fast = 0;
        int r = recv_one(c, buf, DSPX_WIRE_MAX_MSG + 1, block);
        if (r == 0 && block && now_ms() >= deadline - 1) r = dspx_fail(c, -ETIMEDOUT, 0, "no response to %s within %d ms",
                                                                  what ? what : "request", tmo);
        if (r > 0) {
            dspx_wire_header_t h;
            memcpy(&h, buf, sizeof h);
            if (h.seq == seq) {
                pthread_mutex_unlock(&c->lock);
                n = r;
                break;
            }
            r = stash_put(c, buf, r);
            pthread_mutex_unlock(&c->lock);
            if (r < 0) return r;
            if (now_ms() >= deadline) /* a stream of answers to others must not outlast the wait */
                return dspx_fail(c, -ETIMEDOUT, 0, "no response to %s within %d ms", what ? what : "request", tmo);
            continue;
        }
        pthread_mutex_unlock(&c->lock);
        if (r < 0) return r;
        int64_t left = deadline - now_ms();
        if (left <= 0)
            return dspx_fail(c, -ETIMEDOUT, 0, "no response to %s within %d ms", what ? what : "request", tmo);
        /* Slices: another thread may take our response and stash it. */
        struct pollfd p = {c->fd, POLLIN | POLLRDHUP, 0};
        int pr = poll(&p, 1, (int)(left < 20 ? left : 20));
        if (pr < 0 && errno != EINTR) return dspx_fail(c, -errno, 0, "poll: %s", strerror(errno));
    }
    return n;
}

int dspx_check(dspx_conn_t *c, const void *resp, size_t rlen, const char *what) {
    dspx_wire_header_t h;
    memcpy(&h, resp, sizeof h);
    (void)rlen;
    if (h.status == DSPX_STATUS_SUCCESS) return 0;
    int rc = dspx_status_errno(h.status);
    const char *name = dspx_wire_status_name(h.status);
    char detail[DSPX_WIRE_MAX_MSG] = "";
    if (h.type != DSPX_MSG_GET_ERROR_RESP && !c->lost) {
        dspx_wire_get_error_t q;
        memset(&q, 0, sizeof q);
        q.hdr.type = DSPX_MSG_GET_ERROR;
        uint32_t s;
        union {
            dspx_wire_get_error_resp_t r;
            uint8_t b[DSPX_WIRE_MAX_MSG + 1];
        } e;
        size_t el = 0;
        char saved[DSPX_ERR_LEN];
        memcpy(saved, c->last_error, sizeof saved);
        int got = dspx_send(c, &q, sizeof q, -1, &s) == 0 &&
                  dspx_wait(c, s, DSPX_MSG_GET_ERROR_RESP, &e, sizeof e, &el, 5000, "GET_ERROR") == 0;
        if (!got) dspx_forget(c, s);
        if (got && e.r.error_seq == h.seq && el > sizeof e.r) {
            size_t tl = el - sizeof e.r;
            memcpy(detail, e.b + sizeof e.r, tl);
            detail[tl] = 0;
        }
        memcpy(c->last_error, saved, sizeof saved);
    }
    return dspx_fail(c, rc, h.status, "%s (%d) on %s%s%s", name ? name : "STATUS", (int)h.status,
                     what ? what : "request", detail[0] ? ": " : "", detail);
}

int dspx_request(dspx_conn_t *c, void *msg, uint32_t len, int fd, void *resp, size_t cap, size_t *rlen,
                 int timeout_ms) {
    const dspx_wire_header_t *h = (const dspx_wire_header_t *)msg;
    uint32_t type = h->type, s;
    const char *what = dspx_wire_msg_name(type);
    memset(resp, 0, cap); /* callers read its numbers after a failure too */
    int rc = dspx_send(c, msg, len, fd, &s);
    if (rc) return rc;
    size_t n = 0;
    rc = dspx_wait(c, s, type | DSPX_WIRE_RESPONSE_BIT, resp, cap, &n, timeout_ms, what);
    if (rc) {
        dspx_forget(c, s); /* no one waits for it again */
        return rc;
    }
    if (rlen) *rlen = n;
    return dspx_check(c, resp, n, what);
}

/* ------------------------------------------------------------------ dmabufs */

void dspx_buf_init(dspx_buf_t *b) {
    memset(b, 0, sizeof *b);
    b->fd = -1;
}

int dspx_buf_alloc(dspx_conn_t *c, dspx_buf_t *b, size_t size, const char *name) {
    dspx_buf_init(b);
    if (size == 0) return dspx_fail(c, -EINVAL, 0, "dmabuf size must be positive");
    long page = sysconf(_SC_PAGESIZE);
    size_t sz = (size_t)dspx_align(size, (uint64_t)page);
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return dspx_fail(c, -errno, 0, "memfd_create(%zu): %s", sz, strerror(errno));
    if (ftruncate(fd, (off_t)sz) < 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
        int e = errno;
        close(fd);
        return dspx_fail(c, -e, 0, "dmabuf of %zu bytes: %s", sz, strerror(e));
    }
    void *p = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        close(fd);
        return dspx_fail(c, -e, 0, "mmap dmabuf of %zu bytes: %s", sz, strerror(e));
    }
    b->fd = fd;
    b->host = p;
    b->size = sz;
    return 0;
}

void dspx_buf_release(dspx_buf_t *b) {
    if (b->fd < 0) return;
    if (b->host) munmap(b->host, b->size);
    close(b->fd);
    dspx_buf_init(b);
}

/* DMA_BUF_IOCTL_SYNC semantics, whole buffer: start/end of CPU access with
 * READ/WRITE.  A memfd has no cache to maintain; the fence orders our
 * accesses with the device's and the counters show what was synced. */
int dspx_buf_sync(dspx_conn_t *c, dspx_buf_t *b, uint32_t flags) {
    uint32_t dir = flags & (uint32_t)(DSPX_WIRE_SYNC_READ | DSPX_WIRE_SYNC_WRITE);
    if (!dir || (flags & ~(uint32_t)(DSPX_WIRE_SYNC_READ | DSPX_WIRE_SYNC_WRITE | DSPX_WIRE_SYNC_END)))
        return dspx_fail(c, -EINVAL, 0, "bad sync flags 0x%x", flags);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (flags & DSPX_WIRE_SYNC_END) {
        if (b->syncing != (int)dir) return dspx_fail(c, -EINVAL, 0, "sync end without a matching sync start");
        b->syncing = 0;
        if (dir & DSPX_WIRE_SYNC_READ) b->synced_read += b->size;
        if (dir & DSPX_WIRE_SYNC_WRITE) b->synced_write += b->size;
        b->sync_calls++;
    } else {
        b->syncing = (int)dir;
    }
    return 0;
}

int dspx_attach(dspx_conn_t *c, dspx_buf_t *b, uint32_t flags, uint32_t kv_size) {
    dspx_wire_buf_attach_t m;
    memset(&m, 0, sizeof m);
    m.hdr.type = DSPX_MSG_BUF_ATTACH;
    m.size = b->size;
    m.flags = flags;
    m.kv_size = kv_size;
    dspx_wire_buf_attach_resp_t r;
    int rc = dspx_request(c, &m, sizeof m, b->fd, &r, sizeof r, NULL, 0);
    if (rc) return rc;
    if (!r.dsp_addr || r.dsp_addr + b->size < r.dsp_addr) /* 0 means "not attached"; a range must not wrap */
        return dspx_fail(c, -EPROTO, 0, "BUF_ATTACH_RESP gave address 0x%llx for %zu bytes",
                         (unsigned long long)r.dsp_addr, b->size);
    b->dsp_addr = r.dsp_addr;
    return 0;
}

int dspx_detach(dspx_conn_t *c, dspx_buf_t *b) {
    int rc = 0;
    if (b->dsp_addr && c->fd >= 0 && !c->lost) {
        dspx_wire_buf_detach_t m;
        memset(&m, 0, sizeof m);
        m.hdr.type = DSPX_MSG_BUF_DETACH;
        m.dsp_addr = b->dsp_addr;
        dspx_wire_buf_detach_resp_t r;
        rc = dspx_request(c, &m, sizeof m, -1, &r, sizeof r, NULL, 0);
    }
    b->dsp_addr = 0;
    return rc;
}

int dspx_buf_new(dspx_conn_t *c, dspx_buf_t *b, size_t size, const char *name) {
    int rc = dspx_buf_alloc(c, b, size, name);
    if (rc) return rc;
    rc = dspx_attach(c, b, 0, 0);
    if (rc) dspx_buf_release(b);
    return rc;
}

/* ------------------------------------------------------------------ handshake, printf */

static void version_str(uint32_t v, char *out, size_t cap) {
    snprintf(out, cap, "%u.%u.%u", (v >> 16) & 0xFF, (v >> 8) & 0xFF, v & 0xFF);
}

int dspx_conn_handshake(dspx_conn_t *c, size_t printf_size) {
    dspx_wire_ping_t p;
    memset(&p, 0, sizeof p);
    p.hdr.type = DSPX_MSG_PING;
    dspx_wire_ping_resp_t r;
    int rc = dspx_request(c, &p, sizeof p, -1, &r, sizeof r, NULL, c->timeout_ms < 10000 ? c->timeout_ms : 10000);
    if (rc) return rc;
    c->device_version = r.version;
    if ((r.version >> 16) != (DSPX_WIRE_VERSION >> 16)) {
        char h[16], d[16];
        version_str(DSPX_WIRE_VERSION, h, sizeof h);
        version_str(r.version, d, sizeof d);
        return dspx_fail(c, -EPROTONOSUPPORT, 0,
                         "protocol major version mismatch: host speaks %s, device speaks %s", h, d);
    }
    if (printf_size) {
        rc = dspx_buf_new(c, &c->printf_buf, printf_size, "dspx-printf");
        if (rc) return rc;
        dspx_wire_set_printf_buf_t m;
        memset(&m, 0, sizeof m);
        m.hdr.type = DSPX_MSG_SET_PRINTF_BUF;
        m.printf_dsp_addr = c->printf_buf.dsp_addr;
        m.printf_size = (uint32_t)c->printf_buf.size;
        dspx_wire_set_printf_buf_resp_t pr;
        rc = dspx_request(c, &m, sizeof m, -1, &pr, sizeof pr, NULL, 0);
        if (rc) return rc;
        c->printf_read = 0;
    }
    return 0;
}

const char *dspx_printf_collect(dspx_conn_t *c, uint32_t nbytes) {
    if (!c->printf_text) {
        c->printf_cap = 256;
        c->printf_text = malloc(c->printf_cap);
        if (!c->printf_text) return "";
    }
    c->printf_text[0] = 0;
    dspx_buf_t *b = &c->printf_buf;
    if (!nbytes || b->fd < 0) return c->printf_text;
    dspx_buf_sync(c, b, DSPX_WIRE_SYNC_START | DSPX_WIRE_SYNC_READ);
    uint32_t hdr[4];
    memcpy(hdr, b->host, sizeof hdr);
    if (hdr[0] == DSPX_WIRE_PRINTF_MAGIC && hdr[2] > DSPX_WIRE_PRINTF_HEADER && hdr[2] <= b->size) {
        uint32_t cap = hdr[2] - (uint32_t)DSPX_WIRE_PRINTF_HEADER, widx = hdr[1], start = c->printf_read;
        if (widx <= cap && start <= cap) {
            size_t n = widx >= start ? widx - start : cap - start + widx;
            if (n + 1 > c->printf_cap) {
                char *t = realloc(c->printf_text, n + 1);
                if (t) {
                    c->printf_text = t;
                    c->printf_cap = n + 1;
                }
            }
            if (n + 1 <= c->printf_cap) {
                const uint8_t *base = b->host + DSPX_WIRE_PRINTF_HEADER;
                if (widx >= start) {
                    memcpy(c->printf_text, base + start, n);
                } else {
                    memcpy(c->printf_text, base + start, cap - start);
                    memcpy(c->printf_text + (cap - start), base, widx);
                }
                c->printf_text[n] = 0;
            }
            c->printf_read = widx;
        }
    }
    dspx_buf_sync(c, b, DSPX_WIRE_SYNC_END | DSPX_WIRE_SYNC_READ);
    if (c->printf_to_stderr && c->printf_text[0]) {
        fputs(c->printf_text, stderr);
        fflush(stderr);
    }
    return c->printf_text;
}
