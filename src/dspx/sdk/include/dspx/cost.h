/*
 * dspx/cost.h — the timing model's C side (issue 26; the rules are
 * docs/cost-model.md's and COST-SPEC's, identical to dspx.costmodel.clock).
 *
 * A cost build (-DDSPX_COST=1, `dspx build-ops --cost-model`, the SDK's
 * build_ops(cost=True)) makes every IVP intrinsic of dspx/ivp.h also count
 * itself into dspx_cost_tls: loads and stores by where their address lies
 * (inside the core's L2/TCM, or DDR), operations by class.  The runtime shim
 * (its cost build) turns the counts into the modeled clock at every
 * synchronisation point.  Without DSPX_COST nothing here is used and the
 * intrinsics compile exactly as before.
 *
 * The two structs are what the host side mirrors with ctypes
 * (dspx.device.core.native): every field is named as the profile parameter
 * or record key it holds, in this order.
 */
#ifndef DSPX_COST_H
#define DSPX_COST_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The profile parameters the C model reads (a vector-dsp profile's names). */
struct dspx_cost_params {
    double issue_load_store, issue_alu, issue_mul, issue_special, issue_move;
    double ddr_cached, ddr_load_latency_cycles, ddr_store_cycles, tcm_load_latency_cycles;
    double idma_setup_cycles, idma_bandwidth_bytes_per_cycle, call_overhead_cycles;
};

/* One call's record: cycles == overhead + compute + ddr_stall + dma_wait. */
struct dspx_cost_record {
    uint64_t cycles, overhead, compute, ddr_stall, dma_wait;
    uint64_t ddr_loads, ddr_stores, tcm_loads, tcm_stores;
    uint64_t ops_alu, ops_mul, ops_special, ops_move;
    uint64_t dma_bytes[2], dma_transfers[2];
};

/* Set the profile (before the first counted call); 0, or -1 for a value
 * the model cannot use (an issue rate or bandwidth <= 0, a negative cost). */
int dspx_cost_configure(const struct dspx_cost_params *params);
/* Start a call on this thread: the clock at call_overhead_cycles, counts 0. */
void dspx_cost_begin(void);
/* End it: the last segment booked, running transfers waited for. */
void dspx_cost_end(struct dspx_cost_record *out);

/* The counters the intrinsics bump (one block per thread), and the L2 range
 * the shim sets for the running task: an address in [l2_lo, l2_lo + l2_size)
 * is a TCM access, any other a DDR one. */
enum { DSPX_COST_ALU, DSPX_COST_MUL, DSPX_COST_SPECIAL, DSPX_COST_MOVE, DSPX_COST_CLASSES };
struct dspx_cost_counters {
    uintptr_t l2_lo, l2_size;
    uint64_t ddr_loads, ddr_stores, tcm_loads, tcm_stores;
    uint64_t ops[DSPX_COST_CLASSES];
};
extern __thread struct dspx_cost_counters dspx_cost_tls;

#ifdef __cplusplus
}
#endif

#endif /* DSPX_COST_H */
