// What the seed's listing leaves to the user: the tile size and the
// parameter struct its host side fills (hbDSPSoftmaxParam, C layout: 24 bytes).
#ifndef SOFTMAX_H
#define SOFTMAX_H

#include <stdint.h>

// Bytes per ping-pong tile; one tile per L2 bank.  256 KiB stays inside the
// host CPU's L2 cache, which plays the TCM's part here.
#define TILE_SIZE (256 * 1024)

// softmax op param
typedef struct {
  int32_t data_size;
  uint64_t input;
  uint8_t run_tcm_opt;
} hbDSPSoftmaxParam;

#define SOFTMAX_C_CMD 0x3402

int32_t hb_dsp_softmax(void *input, void *output, void *tm);

#endif
