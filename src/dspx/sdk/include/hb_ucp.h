/* hb_ucp.h — Horizon-shaped UCP task API of libdspx (the calls and types the
 * seed's test_softmax_op uses), over the dspx device.
 *
 * The session is implicit, as in UCP: the first call connects to the device
 * on $DSPX_SOCKET (else ${XDG_RUNTIME_DIR:-/tmp}/dspx-<uid>/dsp0.sock); libdspx
 * starts no device of its own (`dspx serve --cores 2`).  Every call returns
 * 0 (HB_UCP_SUCCESS) or a negative errno value; hbUCPGetErrorDesc() names
 * it and hbUCPGetLastErrorText() gives the device's text for the last
 * failure.  Same meanings as the Python Tasks API (src/dspx/host/tasks.py).
 */
#ifndef HB_UCP_H
#define HB_UCP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifndef HB_FLOAT32_T_DEFINED
#define HB_FLOAT32_T_DEFINED
typedef float float32_t;
typedef double float64_t;
#endif

#define HB_UCP_SUCCESS 0

/* Memory the DSP can reach: virAddr is this process's view, phyAddr the
 * address the DSP uses (after hbDSPAddrMap). */
typedef struct hbUCPSysMem {
    uint64_t phyAddr;
    void *virAddr;
    uint64_t memSize;
} hbUCPSysMem;

typedef void *hbUCPTaskHandle_t;

/* backend: which core runs the task (one bit per core; ANY lets the device pick) */
#define HB_UCP_CORE_ANY 0ULL
#define HB_UCP_DSP_CORE_0 (1ULL << 8)
#define HB_UCP_DSP_CORE_1 (1ULL << 9)
#define HB_UCP_DSP_CORE_2 (1ULL << 10)
#define HB_UCP_DSP_CORE_3 (1ULL << 11)
#define HB_UCP_DSP_CORE_ANY (0xFFULL << 8)

#define HB_UCP_PRIORITY_LOWEST 0
#define HB_UCP_PRIORITY_HIGHEST 255

typedef struct hbUCPSchedParam {
    int32_t priority;   /* 0..255, higher runs first */
    int64_t customId;   /* accepted, unused */
    uint64_t backend;   /* HB_UCP_DSP_CORE_n or HB_UCP_DSP_CORE_ANY / HB_UCP_CORE_ANY */
    int32_t deviceId;   /* 0 */
    uint32_t queueTimeoutMs; /* dspx: a task no core started within this is ERR_TIMEOUT (-ETIME); 0 = none */
} hbUCPSchedParam;

#define HB_UCP_INITIALIZE_SCHED_PARAM(param)          \
    do {                                              \
        (param)->priority = HB_UCP_PRIORITY_LOWEST;   \
        (param)->customId = 0;                        \
        (param)->backend = HB_UCP_CORE_ANY;           \
        (param)->deviceId = 0;                        \
        (param)->queueTimeoutMs = 0;                  \
    } while (0)

/* hbUCPMemFlush flags */
#define HB_SYS_MEM_CACHE_INVALIDATE 1 /* before the host reads what the DSP wrote */
#define HB_SYS_MEM_CACHE_CLEAN 2      /* after the host wrote, before the DSP reads */

int32_t hbUCPMalloc(hbUCPSysMem *mem, uint64_t size, int32_t deviceId);
int32_t hbUCPMallocCached(hbUCPSysMem *mem, uint64_t size, int32_t deviceId);
int32_t hbUCPFree(hbUCPSysMem *mem);
int32_t hbUCPMemFlush(hbUCPSysMem *mem, int32_t flag);

int32_t hbUCPSubmitTask(hbUCPTaskHandle_t taskHandle, hbUCPSchedParam *schedParam);
/* timeout in ms; 0 waits up to the library's bound ($DSPX_TIMEOUT_MS, else 60 s): never for ever */
int32_t hbUCPWaitTaskDone(hbUCPTaskHandle_t taskHandle, int32_t timeout);
int32_t hbUCPReleaseTask(hbUCPTaskHandle_t taskHandle);

const char *hbUCPGetErrorDesc(int32_t errorCode);
/* dspx: the text of the last failure on this thread's calls ("" if none) */
const char *hbUCPGetLastErrorText(void);
/* dspx: what a finished task reported */
int32_t hbUCPGetTaskResult(hbUCPTaskHandle_t taskHandle, int32_t *returnValue, uint64_t *cycles, int32_t *core);
/* dspx: close the implicit session (the device frees everything); a later call reconnects */
void hbUCPShutdown(void);

#ifdef __cplusplus
}
#endif

#endif /* HB_UCP_H */
