// c7x_runtime.h — the C++ c7x::Module API of libdspx (libdspx++.so), over
// the C client (c7x_client.h).  DLPack tensors in and out.
//
//   c7x::Module m;                       // connects to $DSPX_SOCKET / the per-user socket
//   m.Load("build/resnet18");            // model.so + metadata.json (+ weights file)
//   DLTensor x = m.CreateInput({1, 3, 224, 224}, {kDLFloat, 32, 1});   // lives in input_buf
//   const auto& out = m.Run({x});        // out[0].dl.data points into output_buf
//
// OutputTensor.dl (its data and shape) is valid until the next Run() or
// Close().  Errors throw c7x::Error carrying the status name and its numbers.
#ifndef C7X_RUNTIME_H
#define C7X_RUNTIME_H

#include <cstddef>
#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string>
#include <vector>

#include "c7x_client.h"
#include "dlpack/dlpack.h"

namespace c7x {

class Error : public std::runtime_error {
 public:
  Error(int code, int32_t status, const std::string& message, uint64_t result_required = 0,
        uint32_t oom_requested = 0, uint32_t oom_free = 0, uint32_t oom_total = 0);
  int code() const { return code_; }                     // negative errno
  int32_t status() const { return status_; }             // DSPX_STATUS_*, 0 when host-side
  const std::string& status_name() const { return status_name_; }  // "ERR_SIZE", or "EFBIG" host-side
  uint64_t result_required() const { return result_required_; }
  uint32_t oom_requested() const { return oom_requested_; }
  uint32_t oom_free() const { return oom_free_; }
  uint32_t oom_total() const { return oom_total_; }

 private:
  int code_;
  int32_t status_;
  std::string status_name_;
  uint64_t result_required_;
  uint32_t oom_requested_, oom_free_, oom_total_;
};

struct TensorInfo {
  std::string name;
  std::vector<int64_t> shape;
  DLDataType dtype;
};

struct OutputTensor {
  DLTensor dl;       // data points into output_buf: valid until the next Run() / Close()
  std::string name;  // from metadata.json, "" if unknown
  size_t nbytes;
};

struct ModuleOptions {
  std::string socket_path;  // "" = $DSPX_SOCKET / the per-user default
  int timeout_ms = 0;       // 0 = $DSPX_TIMEOUT_MS, else 60 s
  bool printf_to_stderr = true;
};

class Module {
 public:
  Module();
  explicit Module(const std::string& socket_path);
  explicit Module(const ModuleOptions& opts);
  ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // A module directory (model.so + metadata.json [+ weights file]) or a .so.
  void Load(const std::string& dir_or_so);
  // Inputs anywhere in host memory (copied once) or from CreateInput (in place).
  const std::vector<OutputTensor>& Run(const std::vector<DLTensor>& inputs, uint32_t flags = 0);
  const std::vector<OutputTensor>& Run(const std::vector<const DLTensor*>& inputs, uint32_t flags = 0);
  // A tensor inside input_buf; its shape array lives until Close().
  DLTensor CreateInput(const std::vector<int64_t>& shape, DLDataType dtype);
  void ReserveIO(size_t input_bytes, size_t output_bytes);
  void Close();

  bool loaded() const { return loaded_; }
  const std::string& entry() const { return entry_; }
  const std::vector<TensorInfo>& inputs() const { return inputs_; }
  const std::vector<TensorInfo>& outputs() const { return outputs_; }
  uint64_t last_cycles() const { return last_cycles_; }
  const std::string& last_printf() const { return last_printf_; }
  const c7x_module_info_t& info() const { return info_; }
  c7x_client_t* client() { return client_; }

 private:
  void Open();
  [[noreturn]] void Throw(int rc, const std::string& what) const;

  ModuleOptions opts_;
  c7x_client_t* client_ = nullptr;
  bool loaded_ = false;
  c7x_module_info_t info_{};
  uint32_t model_id_ = 0;
  std::string entry_ = "main";
  std::vector<TensorInfo> inputs_, outputs_;
  std::vector<OutputTensor> out_;
  std::vector<std::vector<int64_t>> out_shapes_;
  std::deque<std::vector<int64_t>> input_shapes_;
  uint64_t last_cycles_ = 0;
  std::string last_printf_;
};

}  // namespace c7x

#endif  // C7X_RUNTIME_H
