/* libdspx: the Horizon-shaped UCP/DSP task API (hbUCP*, hbDSP*), with the
 * meanings of src/dspx/host/tasks.py: memory is a dmabuf attached to the
 * device (phyAddr = its DSP address), a task is one RPC message naming a
 * command id, a core (or any) and a priority; several tasks may be in
 * flight, matched to their responses by seq; every wait is bounded. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dspx_internal.h"
#include "hb_dsp.h"
#include "hb_ucp.h"

typedef struct hb_mem {
    struct hb_mem *next;
    dspx_buf_t buf;
    uint64_t size;
} hb_mem_t;

enum { T_CREATED, T_SUBMITTED, T_DONE, T_FAILED, T_RELEASED };

typedef struct hb_task {
    struct hb_task *next; /* live tasks: a handle is checked against them */
    uint32_t magic;
    int32_t cmd;
    hb_mem_t *in, *out;
    uint64_t in_size, out_size;
    uint32_t seq;
    int state;
    int rc;
    int32_t return_value;
    int32_t core;
    uint64_t cycles;
    uint32_t queued_us;
} hb_task_t;

#define TASK_MAGIC 0x4B534154u /* "TASK" */

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static dspx_conn_t g_conn;
static int g_open;
static hb_mem_t *g_mems;
static hb_task_t *g_tasks;
static __thread char t_error[DSPX_ERR_LEN];

static int fail(int rc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_error, sizeof t_error, fmt, ap);
    va_end(ap);
    return rc;
}

static int from_conn(int rc) {
    if (rc) snprintf(t_error, sizeof t_error, "%s", g_conn.last_error);
    return rc;
}

/* The implicit session; call with g_lock held. */
static int session(void) {
    if (g_open) {
        if (g_conn.lost) return fail(-ECONNRESET, "the device closed the connection (it exited or was killed)");
        return 0;
    }
    int rc = dspx_conn_open(&g_conn, NULL, 0);
    if (rc) return fail(rc, "%s", dspx_open_error());
    rc = dspx_conn_handshake(&g_conn, (size_t)DSPX_WIRE_PRINTF_SIZE);
    if (rc) {
        fail(rc, "%s", g_conn.last_error);
        dspx_conn_close(&g_conn);
        return rc;
    }
    g_open = 1;
    return 0;
}

DSPX_API void hbUCPShutdown(void) {
    pthread_mutex_lock(&g_lock);
    if (g_open) {
        if (g_conn.fd >= 0) close(g_conn.fd);
        g_conn.fd = -1;
        while (g_mems) {
            hb_mem_t *n = g_mems->next;
            dspx_buf_release(&g_mems->buf);
            free(g_mems);
            g_mems = n;
        }
        dspx_conn_close(&g_conn);
        g_open = 0;
    }
    pthread_mutex_unlock(&g_lock);
}

DSPX_API const char *hbUCPGetLastErrorText(void) { return t_error; }

DSPX_API const char *hbUCPGetErrorDesc(int32_t errorCode) {
    if (errorCode == 0) return "success";
    if (errorCode < 0) return strerror(-errorCode);
    return "unknown error";
}

static hb_mem_t *find_mem(const hbUCPSysMem *m) {
    for (hb_mem_t *p = g_mems; p; p = p->next)
        if (m && p->buf.host == (uint8_t *)m->virAddr) return p;
    return NULL;
}

/* ------------------------------------------------------------------ memory */

DSPX_API int32_t hbUCPMalloc(hbUCPSysMem *mem, uint64_t size, int32_t deviceId) {
    t_error[0] = 0;
    if (!mem) return fail(-EINVAL, "hbUCPMalloc: NULL mem");
    if (size == 0) return fail(-EINVAL, "hbUCPMalloc: size 0");
    if (deviceId != 0) return fail(-ENODEV, "hbUCPMalloc: device %d (only device 0 exists)", deviceId);
    pthread_mutex_lock(&g_lock);
    int rc = session();
    hb_mem_t *m = NULL;
    if (!rc) {
        m = calloc(1, sizeof *m);
        if (!m) rc = fail(-ENOMEM, "out of host memory");
    }
    if (!rc) {
        rc = from_conn(dspx_buf_new(&g_conn, &m->buf, (size_t)size, "dspx-ucp"));
        if (rc) {
            free(m);
        } else {
            m->size = size;
            m->next = g_mems;
            g_mems = m;
            mem->virAddr = m->buf.host;
            mem->phyAddr = m->buf.dsp_addr;
            mem->memSize = size;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

DSPX_API int32_t hbUCPMallocCached(hbUCPSysMem *mem, uint64_t size, int32_t deviceId) {
    return hbUCPMalloc(mem, size, deviceId);
}

DSPX_API int32_t hbUCPFree(hbUCPSysMem *mem) {
    t_error[0] = 0;
    pthread_mutex_lock(&g_lock);
    hb_mem_t **pp = &g_mems;
    while (*pp && (!mem || (*pp)->buf.host != (uint8_t *)mem->virAddr)) pp = &(*pp)->next;
    int rc = 0;
    if (!*pp) {
        rc = fail(-EFAULT, "hbUCPFree: %p is not memory from hbUCPMalloc", mem ? mem->virAddr : NULL);
    } else {
        hb_mem_t *m = *pp;
        rc = g_open && !g_conn.lost ? from_conn(dspx_detach(&g_conn, &m->buf)) : 0;
        if (rc != -EBUSY) { /* a buffer a running task still uses stays */
            *pp = m->next;
            dspx_buf_release(&m->buf);
            free(m);
            mem->virAddr = NULL;
            mem->phyAddr = 0;
            mem->memSize = 0;
            if (rc == -ECONNRESET) rc = 0;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

DSPX_API int32_t hbUCPMemFlush(hbUCPSysMem *mem, int32_t flag) {
    t_error[0] = 0;
    pthread_mutex_lock(&g_lock);
    hb_mem_t *m = find_mem(mem);
    int rc = 0;
    if (!m) {
        rc = fail(-EFAULT, "hbUCPMemFlush: not memory from hbUCPMalloc");
    } else {
        uint32_t dir = flag == HB_SYS_MEM_CACHE_INVALIDATE ? DSPX_WIRE_SYNC_READ
                       : flag == HB_SYS_MEM_CACHE_CLEAN    ? DSPX_WIRE_SYNC_WRITE
                                                           : 0;
        if (!dir) {
            rc = fail(-EINVAL, "hbUCPMemFlush: flag %d", flag);
        } else {
            rc = from_conn(dspx_buf_sync(&g_conn, &m->buf, DSPX_WIRE_SYNC_START | dir));
            if (!rc) rc = from_conn(dspx_buf_sync(&g_conn, &m->buf, DSPX_WIRE_SYNC_END | dir));
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

DSPX_API int32_t hbDSPAddrMap(hbUCPSysMem *in, hbUCPSysMem *out) {
    t_error[0] = 0;
    if (!in || !out) return fail(-EINVAL, "hbDSPAddrMap: NULL argument");
    pthread_mutex_lock(&g_lock);
    hb_mem_t *m = find_mem(in);
    int rc = 0;
    if (!m) {
        rc = fail(-EFAULT, "hbDSPAddrMap: %p is not memory from hbUCPMalloc", in->virAddr);
    } else {
        uint64_t size = in->memSize;
        out->virAddr = m->buf.host;
        out->phyAddr = m->buf.dsp_addr; /* the DSP sees the dmabuf at its attach address */
        out->memSize = size;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

DSPX_API int32_t hbDSPAddrUnmap(hbUCPSysMem *mem) {
    t_error[0] = 0;
    pthread_mutex_lock(&g_lock);
    int rc = find_mem(mem) ? 0 : fail(-EFAULT, "hbDSPAddrUnmap: not memory from hbUCPMalloc");
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ------------------------------------------------------------------ tasks */

static hb_task_t *task_of(hbUCPTaskHandle_t h) {
    pthread_mutex_lock(&g_lock);
    hb_task_t *t = g_tasks;
    while (t && t != (hb_task_t *)h) t = t->next;
    pthread_mutex_unlock(&g_lock);
    return t && t->magic == TASK_MAGIC ? t : NULL;
}

DSPX_API int32_t hbDSPRpcV2(hbUCPTaskHandle_t *taskHandle, hbUCPSysMem *input, hbUCPSysMem *output,
                            int32_t rpcCmd) {
    t_error[0] = 0;
    if (!taskHandle) return fail(-EINVAL, "hbDSPRpcV2: NULL task handle");
    pthread_mutex_lock(&g_lock);
    hb_mem_t *in = find_mem(input), *out = find_mem(output);
    int rc = 0;
    if ((input && !in) || (output && !out)) {
        rc = fail(-EFAULT, "hbDSPRpcV2: %s is not memory from hbUCPMalloc", input && !in ? "input" : "output");
    } else {
        hb_task_t *t = calloc(1, sizeof *t);
        if (!t) {
            rc = fail(-ENOMEM, "out of host memory");
        } else {
            t->magic = TASK_MAGIC;
            t->cmd = rpcCmd;
            t->in = in;
            t->out = out;
            t->in_size = in ? (input->memSize ? input->memSize : in->size) : 0;
            t->out_size = out ? (output->memSize ? output->memSize : out->size) : 0;
            t->state = T_CREATED;
            t->core = -1;
            t->next = g_tasks;
            g_tasks = t;
            *taskHandle = t;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static int32_t core_of(uint64_t backend) {
    uint64_t dsp = (backend >> 8) & 0xFF;
    if (backend == HB_UCP_CORE_ANY || dsp == 0xFF) return DSPX_WIRE_CORE_ANY;
    if (dsp && !(dsp & (dsp - 1))) return __builtin_ctzll(dsp);
    return -2; /* several cores but not all: not expressible */
}

DSPX_API int32_t hbUCPSubmitTask(hbUCPTaskHandle_t taskHandle, hbUCPSchedParam *schedParam) {
    t_error[0] = 0;
    hb_task_t *t = task_of(taskHandle);
    if (!t) return fail(-EINVAL, "hbUCPSubmitTask: not a task handle");
    if (t->state != T_CREATED)
        return fail(-EINVAL, "hbUCPSubmitTask: the task was already submitted; create a new one with hbDSPRpcV2");
    hbUCPSchedParam def;
    if (!schedParam) {
        HB_UCP_INITIALIZE_SCHED_PARAM(&def);
        schedParam = &def;
    }
    if (schedParam->priority < 0 || schedParam->priority > 255)
        return fail(-EINVAL, "hbUCPSubmitTask: priority %d outside 0..255", schedParam->priority);
    int32_t core = core_of(schedParam->backend);
    if (core == -2) return fail(-EINVAL, "hbUCPSubmitTask: backend 0x%llx names several cores but not all",
                                (unsigned long long)schedParam->backend);
    pthread_mutex_lock(&g_lock);
    int rc = session();
    if (!rc) {
        /* the device reads what the host wrote */
        dspx_buf_t *bs[2] = {t->in ? &t->in->buf : NULL, t->out ? &t->out->buf : NULL};
        for (int i = 0; i < 2; i++) {
            if (!bs[i]) continue;
            dspx_buf_sync(&g_conn, bs[i], DSPX_WIRE_SYNC_START | DSPX_WIRE_SYNC_WRITE);
            dspx_buf_sync(&g_conn, bs[i], DSPX_WIRE_SYNC_END | DSPX_WIRE_SYNC_WRITE);
        }
        dspx_wire_rpc_t m;
        memset(&m, 0, sizeof m);
        m.hdr.type = DSPX_MSG_RPC;
        m.cmd = (uint32_t)t->cmd;
        m.core = core;
        m.priority = (uint32_t)schedParam->priority;
        m.timeout_ms = schedParam->queueTimeoutMs;
        m.input_dsp_addr = t->in ? t->in->buf.dsp_addr : 0;
        m.input_size = t->in_size;
        m.output_dsp_addr = t->out ? t->out->buf.dsp_addr : 0;
        m.output_size = t->out_size;
        rc = from_conn(dspx_send(&g_conn, &m, sizeof m, -1, &t->seq));
        if (!rc) t->state = T_SUBMITTED;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

DSPX_API int32_t hbUCPWaitTaskDone(hbUCPTaskHandle_t taskHandle, int32_t timeout) {
    t_error[0] = 0;
    hb_task_t *t = task_of(taskHandle);
    if (!t) return fail(-EINVAL, "hbUCPWaitTaskDone: not a task handle");
    if (t->state == T_DONE) return 0;
    if (t->state == T_FAILED) return t->rc;
    if (t->state != T_SUBMITTED) return fail(-EINVAL, "hbUCPWaitTaskDone: the task was not submitted");
    if (timeout < 0) return fail(-EINVAL, "hbUCPWaitTaskDone: negative timeout");
    char what[32];
    snprintf(what, sizeof what, "RPC 0x%x", (unsigned)t->cmd);
    dspx_wire_rpc_resp_t r;
    size_t n = 0;
    /* no g_lock here: other threads submit and wait meanwhile */
    int rc = dspx_wait(&g_conn, t->seq, DSPX_MSG_RPC_RESP, &r, sizeof r, &n, timeout, what);
    if (rc == -ETIMEDOUT) return from_conn(rc); /* still in flight: may be waited for again */
    if (rc) {
        t->state = T_FAILED;
        t->rc = from_conn(rc);
        return rc;
    }
    pthread_mutex_lock(&g_lock);
    dspx_printf_collect(&g_conn, r.printf_size);
    if (t->out) {
        dspx_buf_sync(&g_conn, &t->out->buf, DSPX_WIRE_SYNC_START | DSPX_WIRE_SYNC_READ);
        dspx_buf_sync(&g_conn, &t->out->buf, DSPX_WIRE_SYNC_END | DSPX_WIRE_SYNC_READ);
    }
    t->return_value = r.return_value;
    t->cycles = r.cycles;
    t->core = (int32_t)r.core;
    t->queued_us = r.queued_us;
    rc = from_conn(dspx_check(&g_conn, &r, n, what));
    if (!rc && r.return_value != 0)
        rc = fail(-EREMOTEIO, "operator 0x%x returned %d", (unsigned)t->cmd, r.return_value);
    pthread_mutex_unlock(&g_lock);
    t->state = rc ? T_FAILED : T_DONE;
    t->rc = rc;
    return rc;
}

DSPX_API int32_t hbUCPReleaseTask(hbUCPTaskHandle_t taskHandle) {
    t_error[0] = 0;
    hb_task_t *t = task_of(taskHandle);
    if (!t) return fail(-EINVAL, "hbUCPReleaseTask: not a task handle");
    if (t->state == T_SUBMITTED) return fail(-EBUSY, "task is still in flight: wait for it before releasing");
    pthread_mutex_lock(&g_lock);
    for (hb_task_t **p = &g_tasks; *p; p = &(*p)->next)
        if (*p == t) {
            *p = t->next;
            break;
        }
    pthread_mutex_unlock(&g_lock);
    t->magic = 0;
    t->state = T_RELEASED;
    free(t);
    return 0;
}

DSPX_API int32_t hbUCPGetTaskResult(hbUCPTaskHandle_t taskHandle, int32_t *returnValue, uint64_t *cycles,
                                    int32_t *core) {
    hb_task_t *t = task_of(taskHandle);
    if (!t) return fail(-EINVAL, "hbUCPGetTaskResult: not a task handle");
    if (t->state != T_DONE && t->state != T_FAILED) return fail(-EINVAL, "the task has not finished");
    if (returnValue) *returnValue = t->return_value;
    if (cycles) *cycles = t->cycles;
    if (core) *core = t->core;
    return 0;
}
