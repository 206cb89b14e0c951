/*
 * dspx/dsp.h — the DSP-side operator SDK (one header for C and C++).
 *
 * The API is the Horizon UCP seed's own (hb_dsp_register_fn, hb_dsp_mem_map,
 * xvAllocateBuffer, IDMA_COPY / IDMA_WAIT, DSP_LOG*, TIME_STAMP) plus a
 * C7x-style 2-D/3-D auto-increment transfer (TI's DmaUtilsAutoInc3d), and
 * dspx/ivp.h, the emulation of the Vision DSP vector intrinsics the seed's
 * softmax uses.  A library defines
 *
 *     extern "C" int dspx_ops_init(void);   // calls hb_dsp_register_fn
 *
 * and is built with `dspx build-ops SRC... -o LIB.so`.  Everything below is
 * implemented by the core's runtime shim (src/dspx/sdk/dsp/runtime.c); the
 * undefined symbols a library may have are exactly these functions plus the
 * libc/libm subset listed in docs/custom-ops.md.
 *
 * Errors: a call that fails writes "[dspx] <Error>: why" into the task's
 * printf and remembers the error's status; a handler that then returns
 * non-zero finishes the task with that status (ERR_ADDR for a bad mem_map,
 * ERR_NOMEM for tile exhaustion, ERR_INVALID for misuse, ERR_TIMEOUT for a
 * DMA wait that timed out), just as the typed error would in a Python op.
 */
#ifndef DSPX_DSP_H
#define DSPX_DSP_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h> /* MAP_FAILED */
#ifndef __cplusplus
#include <stdbool.h>
#endif

#include "cost.h"

#ifdef __cplusplus
#define restrict __restrict
extern "C" {
#endif

typedef float float32_t;

/* ------------------------------------------------------------ registration */

/* handler(input, output, tm) -> 0 on success.  input/output are the task's
 * two buffers (host pointers), tm the core's tile manager. */
typedef int (*handle_fn)(void *input, void *output, void *tm);

/* Register handle under cmd; only valid while dspx_ops_init runs.  latency
 * is a hint in microseconds (0 = unknown).  0, or a negative status. */
int hb_dsp_register_fn(int cmd, handle_fn handle, int latency);

/* Defined by the library: registers its operators. */
int dspx_ops_init(void);

/* Sizes in bytes of the running task's input and output buffers (dspx). */
size_t dspx_input_size(void);
size_t dspx_output_size(void);

/* ------------------------------------------------------------ memory */

/* The task connection's DSP range [dsp_addr, dsp_addr+size) as a host
 * pointer, range-checked like inference: MAP_FAILED unless it lies wholly
 * inside one of the connection's buffers. */
void *hb_dsp_mem_map(uint64_t dsp_addr, uint32_t size);
/* Give a mapping back.  Accepts the pointer, or its low 32 bits (the seed
 * unmaps with hb_dsp_mem_unmap((uint32_t)src)).  0, or a negative status. */
int hb_dsp_mem_unmap(uint64_t addr);

#define HB_ERR_MMAP_FAILED (-6) /* = dspx ERR_ADDR */

/* ------------------------------------------------------------ L2 tiles */

/* The core's L2 SRAM: bank (colour) 0 is its first half, bank 1 the second. */
typedef struct xvTileManager xvTileManager;
#define XV_MEM_BANK_COLOR_0 0
#define XV_MEM_BANK_COLOR_1 1
#define XVTM_SUCCESS 0
#define XVTM_ERROR (-1)

/* size bytes in bank color, the address a multiple of align (a power of
 * two); NULL (and ERR_NOMEM noted) when the bank has no hole that large. */
void *xvAllocateBuffer(xvTileManager *tm, int32_t size, int32_t color, int32_t align);
/* XVTM_SUCCESS, or XVTM_ERROR for a pointer that is not a live tile.  DMA
 * copies still in flight on the tile are waited for first. */
int32_t xvFreeBuffer(xvTileManager *tm, void const *buf);

/* ------------------------------------------------------------ IDMA */

#define HB_IDMA_CH0 0
#define HB_IDMA_CH1 1
#define DSPX_DMA_CHANNELS 2

/* Queue a copy of nbytes from src to dst on a channel; returns at once with
 * a ticket >= 0, or a negative status (bad channel or size, a range outside
 * the task's buffers and live tiles).  Copies on one channel run in order,
 * on the core's DMA engine, concurrently with compute. */
int32_t dspx_idma_copy(int32_t ch, const void *src, void *dst, int32_t nbytes);
/* Wait until every copy queued on the channel is done: 0, or a negative
 * status.  With nothing in flight it returns 0 at once. */
int32_t dspx_idma_wait(int32_t ch);

/* The seed writes these as statements with no trailing semicolon. */
#define IDMA_COPY(ch, ret, src, dst, nbytes) { (ret) = dspx_idma_copy((ch), (src), (dst), (int32_t)(nbytes)); }
#define IDMA_WAIT(ch, ret) { (ret) = dspx_idma_wait((ch)); }

/* ------------------------------------------------------------ C7x-style 3-D auto-increment DMA */

/* A transfer walks up to four nested loops on each side:
 *   addr(i0, i1, i2, i3) = ptr + i0 + i1*dim1 + i2*dim2 + i3*dim3
 * (icnt0 counts bytes, dims are byte strides, may be negative).  Source
 * bytes in that order land in destination bytes in its order.  Each
 * trigger moves one block: a row (SYNC_1D), an icnt0 x icnt1 plane
 * (SYNC_2D), an icnt0 x icnt1 x icnt2 cube (SYNC_3D) or everything
 * (SYNC_4D); source and destination blocks must hold the same bytes. */
#define DMAUTILSAUTOINC3D_SYNC_1D 0
#define DMAUTILSAUTOINC3D_SYNC_2D 1
#define DMAUTILSAUTOINC3D_SYNC_3D 2
#define DMAUTILSAUTOINC3D_SYNC_4D 3

typedef struct {
    int32_t sicnt0, sicnt1, sicnt2, sicnt3;
    int32_t sdim1, sdim2, sdim3;
    int32_t dicnt0, dicnt1, dicnt2, dicnt3;
    int32_t ddim1, ddim2, ddim3;
} DmaUtilsAutoInc3d_TransferDim;

typedef struct {
    uint8_t *srcPtr;
    uint8_t *dstPtr;
} DmaUtilsAutoInc3d_IOPointers;

typedef struct {
    int32_t syncType;
    DmaUtilsAutoInc3d_TransferDim transferDim;
    DmaUtilsAutoInc3d_IOPointers ioPointers;
} DmaUtilsAutoInc3d_TransferProp;

/* Bind a transfer to a channel (checked whole: both patterns inside the
 * task's buffers/tiles): the number of blocks, or a negative status. */
int32_t DmaUtilsAutoInc3d_configure(int32_t ch, const DmaUtilsAutoInc3d_TransferProp *prop);
/* Queue the next block; returns the blocks left after it (>= 0), or a
 * negative status (nothing configured, all blocks already triggered). */
int32_t DmaUtilsAutoInc3d_trigger(int32_t ch);
/* Wait for every block (and copy) queued on the channel: 0 or negative. */
int32_t DmaUtilsAutoInc3d_wait(int32_t ch);
/* Forget the channel's transfer (waits for its blocks first). */
int32_t DmaUtilsAutoInc3d_deconfigure(int32_t ch);

/* ------------------------------------------------------------ printf, logs, cycles */

/* Into the task's printf ring (the host reads it after the task). */
int dspx_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void dspx_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define printf dspx_printf

/* Levels: 0 debug ("D: "), 1 info (plain), 2 error ("E: "); a newline is
 * added when the message has none.  DSP_LOGD is compiled out unless the
 * library is built with -DDSP_LOG_LEVEL=0. */
#ifndef DSP_LOG_LEVEL
#define DSP_LOG_LEVEL 1
#endif
#define DSP_LOGD(...) do { if (DSP_LOG_LEVEL <= 0) dspx_log(0, __VA_ARGS__); } while (0)
#define DSP_LOGI(...) do { if (DSP_LOG_LEVEL <= 1) dspx_log(1, __VA_ARGS__); } while (0)
#define DSP_LOGE(...) dspx_log(2, __VA_ARGS__)

/* The 64-bit cycle counter: CLOCK_MONOTONIC ns at the nominal 1 GHz; while
 * a cost model counts the call (dspx/cost.h), the modeled clock instead:
 * cycles since the call began, its overhead included. */
uint64_t dspx_cycles(void);
/* Declares var and stores the counter in it (the seed: TIME_STAMP(cycles_start);). */
#define TIME_STAMP(var) uint64_t var = dspx_cycles()

/* Returns ret from the calling function when cond holds (logged as an error). */
#define PRT_IF_COND_RETURN(cond, ret) \
    { if (cond) { DSP_LOGE("%s:%d: %s, returning %s", __FILE__, __LINE__, #cond, #ret); return (ret); } }

#define XT_MIN(a, b) ((a) < (b) ? (a) : (b))
#define XT_MAX(a, b) ((a) > (b) ? (a) : (b))

/* Used by the emulated aligning loads at page boundaries (see ivp.h). */
void dspx_ivp_guarded_load(const void *p, void *out, int nbytes);

#ifdef __cplusplus
}
#endif

#if DSPX_COST
/* Marks a cost build: the core counts its calls (a plain build's record
 * says "counted": false). */
#ifdef __cplusplus
extern "C" __attribute__((weak, visibility("default"))) const int dspx_cost_build = 1;
#else
__attribute__((weak, visibility("default"))) const int dspx_cost_build = 1;
#endif
#endif

/* The seed's listing assigns its profile to this without declaring it. */
static int self_cycles __attribute__((unused));

#include "ivp.h"

#endif /* DSPX_DSP_H */
