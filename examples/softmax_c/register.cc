// Registration: what the seed does before hb_dsp_start, done when the
// library is loaded (dspx load-ops).
#include <dspx/dsp.h>

#include "softmax.h"

extern "C" int dspx_ops_init(void) {
  return hb_dsp_register_fn(SOFTMAX_C_CMD, hb_dsp_softmax, 0);
}
