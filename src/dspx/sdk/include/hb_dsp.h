/* hb_dsp.h — Horizon-shaped DSP calls of libdspx: map memory for the DSP and
 * create an RPC task for a custom operator's command id (hbDSPRpcV2).
 * Submit / wait / release it with hb_ucp.h. */
#ifndef HB_DSP_H
#define HB_DSP_H

#include "hb_ucp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out = in with phyAddr the DSP address of the buffer (in may equal out). */
int32_t hbDSPAddrMap(hbUCPSysMem *in, hbUCPSysMem *out);
int32_t hbDSPAddrUnmap(hbUCPSysMem *mem);

/* A task running operator rpcCmd on (input, output); both from hbUCPMalloc. */
int32_t hbDSPRpcV2(hbUCPTaskHandle_t *taskHandle, hbUCPSysMem *input, hbUCPSysMem *output, int32_t rpcCmd);

#ifdef __cplusplus
}
#endif

#endif /* HB_DSP_H */
