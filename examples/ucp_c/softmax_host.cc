// The seed's host program (ucp-dsp-custom-operator, "UCP API"): test_softmax_op
// exactly as the seed has it; only the includes, the logging/check macros it
// uses and a main() are added.  It runs the softmax operator (cmd 0x1402) on
// the DSP twice — direct over DDR, then tiled ping-pong through L2 — and
// compares the two.
//
//   dspx serve --cores 2 &
//   c++ -std=c++17 softmax_host.cc $(dspx sdk --cflags --libs) -o softmax_host && ./softmax_host
//
// The seed's own code draws two warnings under -Wall -Wextra (int32_t size
// against a uint32_t loop index; argc/argv unused): the example build turns
// exactly those two off rather than change the seed.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>

#include "hb_dsp.h"
#include "hb_ucp.h"

// ---- logging in the seed's style: LOGI("x {} y {}", a, b)
namespace seedlog {
inline void format_to(std::ostringstream& os, const char* f) { os << f; }
template <typename T, typename... Rest>
void format_to(std::ostringstream& os, const char* f, const T& v, const Rest&... rest) {
  for (; *f; ++f) {
    if (f[0] == '{' && f[1] == '}') {
      os << v;
      format_to(os, f + 2, rest...);
      return;
    }
    os << *f;
  }
}
template <typename... Args>
void log(FILE* out, const char* level, const char* f, const Args&... args) {
  std::ostringstream os;
  format_to(os, f, args...);
  std::fprintf(out, "[%s] %s\n", level, os.str().c_str());
  std::fflush(out);
}
}  // namespace seedlog

#define LOGI(...) seedlog::log(stdout, "I", __VA_ARGS__)
#define LOGE(...) seedlog::log(stderr, "E", __VA_ARGS__)

#define HB_CHECK_SUCCESS(value, errmsg)                                              \
  do {                                                                               \
    auto ret_code = (value);                                                         \
    if (ret_code != 0) {                                                             \
      LOGE("{}, error code: {} ({}): {}", errmsg, ret_code, hbUCPGetErrorDesc(ret_code), \
           hbUCPGetLastErrorText());                                                 \
      return ret_code;                                                               \
    }                                                                                \
  } while (0)

// ---------------------------------------------------------------- the seed, unchanged

// softmax op param
typedef struct {
  int32_t data_size;
  uint64_t input;
  uint8_t run_tcm_opt;
} hbDSPSoftmaxParam;

// #define DEBUG_RESULT

int32_t test_softmax_op(int32_t argc, char **argv) {
  LOGI("softmax op begin");

  int32_t size = 100000;
  int32_t data_size = size * sizeof(float32_t);

  hbUCPSysMem input_mem, output_mem, output_opt_mem;

  // prepare input data
  hbUCPSysMem input_data;
  HB_CHECK_SUCCESS(hbUCPMalloc(&input_data, data_size, 0),
                   "hbUCPMalloc input_data failed");
  HB_CHECK_SUCCESS(hbDSPAddrMap(&input_data, &input_data),
                   "Failed to hbDSPAddrMap input_data");

  float32_t *data_ptr = static_cast<float32_t *>(input_data.virAddr);
  for (uint32_t i = 0U; i < size; ++i) {
    data_ptr[i] = 1 + i / float32_t(size);
  }

  HB_CHECK_SUCCESS(hbUCPMalloc(&output_mem, data_size, 0),
                   "hbUCPMalloc output_mem failed");
  HB_CHECK_SUCCESS(hbDSPAddrMap(&output_mem, &output_mem),
                   "Failed to hbDSPAddrMap output_mem");
  HB_CHECK_SUCCESS(hbUCPMalloc(&output_opt_mem, data_size, 0),
                   "hbUCPMalloc output_opt_mem failed");
  HB_CHECK_SUCCESS(hbDSPAddrMap(&output_opt_mem, &output_opt_mem),
                   "Failed to hbDSPAddrMap output_opt_mem");
  HB_CHECK_SUCCESS(hbUCPMalloc(&input_mem, sizeof(hbDSPSoftmaxParam), 0),
                   "hbUCPMalloc input_mem failed");
  HB_CHECK_SUCCESS(hbDSPAddrMap(&input_mem, &input_mem),
                   "Failed to hbDSPAddrMap input_mem");
  hbDSPSoftmaxParam *ptr = static_cast<hbDSPSoftmaxParam *>(input_mem.virAddr);
  ptr->data_size = data_size;
  ptr->input = input_data.phyAddr;
  ptr->run_tcm_opt = 0;

  // ctrl param
  hbUCPSchedParam sched_param;
  HB_UCP_INITIALIZE_SCHED_PARAM(&sched_param);
  sched_param.backend = HB_UCP_DSP_CORE_0;
  sched_param.priority = 0;

  // run without ping-pong
  hbUCPTaskHandle_t task{nullptr};
  HB_CHECK_SUCCESS(hbDSPRpcV2(&task, &input_mem, &output_mem, 0x1402),
                   "hbDSPRpcV2 failed");
  HB_CHECK_SUCCESS(hbUCPSubmitTask(task, &sched_param), "hbUCPSubmitTask failed");
  HB_CHECK_SUCCESS(hbUCPWaitTaskDone(task, 0), "hbUCPWaitTaskDone failed");
  HB_CHECK_SUCCESS(hbUCPReleaseTask(task), "hbUCPReleaseTask failed");

  // run without ping-pong
  ptr->run_tcm_opt = 1;
  task = nullptr;
  HB_CHECK_SUCCESS(hbDSPRpcV2(&task, &input_mem, &output_opt_mem, 0x1402),
                   "hbDSPRpcV2 failed");
  HB_CHECK_SUCCESS(hbUCPSubmitTask(task, &sched_param), "hbUCPSubmitTask failed");
  HB_CHECK_SUCCESS(hbUCPWaitTaskDone(task, 0), "hbUCPWaitTaskDone failed");
  HB_CHECK_SUCCESS(hbUCPReleaseTask(task), "hbUCPReleaseTask failed");

  float32_t *dst_data_ptr = static_cast<float32_t *>(output_mem.virAddr);
  float32_t *dst_opt_data_ptr =
      static_cast<float32_t *>(output_opt_mem.virAddr);
  bool flag{true};
  for (uint32_t i = 0U; i < size; ++i) {
    if (std::abs(dst_data_ptr[i] - dst_opt_data_ptr[i]) /
            std::abs(dst_data_ptr[i]) >
        1e-6) {
      LOGE("opt vs non-opt result is diff {}, dst {} opt {}", i,
           dst_data_ptr[i], dst_opt_data_ptr[i]);
      flag = false;
      break;
    }
  }
  if (flag) {
    LOGI("opt vs non-opt result is same");
  }

  hbDSPAddrUnmap(&input_mem);
  hbUCPFree(&input_mem);
  hbDSPAddrUnmap(&output_mem);
  hbUCPFree(&output_mem);
  hbDSPAddrUnmap(&output_opt_mem);
  hbUCPFree(&output_opt_mem);
  hbDSPAddrUnmap(&input_data);
  hbUCPFree(&input_data);
  LOGI("softmax op finish");
  return 0;
}

// ---------------------------------------------------------------- added

int main(int argc, char **argv) { return test_softmax_op(argc, argv) == 0 ? 0 : 1; }
