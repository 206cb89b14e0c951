// libdspx++: c7x::Module over the C client; what dspx.host.vm.VirtualMachine
// does: load model.so and the weights file named by metadata.json, run on
// DLPack tensors, outputs as views of output_buf.
#include "c7x_runtime.h"
#include "dspx_shape.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <sys/stat.h>

#define DSPX_API __attribute__((visibility("default")))

namespace {

// ---------------------------------------------------------------- a small JSON reader (metadata.json)
struct JValue {
  enum Kind { Null, Bool, Num, Str, Arr, Obj } kind = Null;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<JValue> arr;
  std::vector<std::pair<std::string, JValue>> obj;
  const JValue* get(const std::string& k) const {
    if (kind != Obj) return nullptr;
    for (auto& kv : obj)
      if (kv.first == k) return &kv.second;
    return nullptr;
  }
};

class JParser {
 public:
  explicit JParser(const std::string& s) : s_(s) {}
  JValue parse() {
    JValue v = value();
    ws();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const char* why) {
    throw std::runtime_error(std::string("metadata.json: ") + why + " at byte " + std::to_string(i_));
  }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) i_++;
  }
  bool lit(const char* w) {
    size_t n = std::strlen(w);
    if (s_.compare(i_, n, w) == 0) {
      i_ += n;
      return true;
    }
    return false;
  }
  JValue value() {
    ws();
    if (i_ >= s_.size()) fail("unexpected end");
    JValue v;
    char c = s_[i_];
    if (c == '{') {
      v.kind = JValue::Obj;
      i_++;
      ws();
      if (i_ < s_.size() && s_[i_] == '}') {
        i_++;
        return v;
      }
      for (;;) {
        ws();
        std::string k = string();
        ws();
        if (i_ >= s_.size() || s_[i_] != ':') fail("expected ':'");
        i_++;
        v.obj.emplace_back(k, value());
        ws();
        if (i_ < s_.size() && s_[i_] == ',') {
          i_++;
          continue;
        }
        if (i_ < s_.size() && s_[i_] == '}') {
          i_++;
          return v;
        }
        fail("expected ',' or '}'");
      }
    }
    if (c == '[') {
      v.kind = JValue::Arr;
      i_++;
      ws();
      if (i_ < s_.size() && s_[i_] == ']') {
        i_++;
        return v;
      }
      for (;;) {
        v.arr.push_back(value());
        ws();
        if (i_ < s_.size() && s_[i_] == ',') {
          i_++;
          continue;
        }
        if (i_ < s_.size() && s_[i_] == ']') {
          i_++;
          return v;
        }
        fail("expected ',' or ']'");
      }
    }
    if (c == '"') {
      v.kind = JValue::Str;
      v.str = string();
      return v;
    }
    if (lit("true")) {
      v.kind = JValue::Bool;
      v.b = true;
      return v;
    }
    if (lit("false")) {
      v.kind = JValue::Bool;
      return v;
    }
    if (lit("null")) return v;
    size_t start = i_;
    while (i_ < s_.size() && std::strchr("+-0123456789.eE", s_[i_])) i_++;
    if (start == i_) fail("unexpected character");
    v.kind = JValue::Num;
    v.num = std::strtod(s_.substr(start, i_ - start).c_str(), nullptr);
    return v;
  }
  std::string string() {
    if (i_ >= s_.size() || s_[i_] != '"') fail("expected a string");
    i_++;
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c == '\\' && i_ < s_.size()) {
        char e = s_[i_++];
        switch (e) {
          case 'n': out += '\n'; break;
          case 't': out += '\t'; break;
          case 'r': out += '\r'; break;
          case 'b': out += '\b'; break;
          case 'f': out += '\f'; break;
          case 'u': {  // keep ASCII, replace the rest
            unsigned cp = std::stoul(s_.substr(i_, 4), nullptr, 16);
            i_ += 4;
            out += cp < 0x80 ? static_cast<char>(cp) : '?';
            break;
          }
          default: out += e;
        }
      } else {
        out += c;
      }
    }
    if (i_ >= s_.size()) fail("unterminated string");
    i_++;
    return out;
  }
  const std::string& s_;
  size_t i_ = 0;
};

bool is_dir(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool is_file(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}
std::string parent_of(const std::string& p) {
  auto k = p.find_last_of('/');
  return k == std::string::npos ? "." : p.substr(0, k);
}

bool parse_dtype(const std::string& name, DLDataType* out) {
  static const std::map<std::string, DLDataType> table = {
      {"int8", {kDLInt, 8, 1}},     {"int16", {kDLInt, 16, 1}},     {"int32", {kDLInt, 32, 1}},
      {"int64", {kDLInt, 64, 1}},   {"uint8", {kDLUInt, 8, 1}},     {"uint16", {kDLUInt, 16, 1}},
      {"uint32", {kDLUInt, 32, 1}}, {"uint64", {kDLUInt, 64, 1}},   {"float16", {kDLFloat, 16, 1}},
      {"float32", {kDLFloat, 32, 1}}, {"float64", {kDLFloat, 64, 1}}};
  auto it = table.find(name);
  if (it == table.end()) return false;
  *out = it->second;
  return true;
}

std::vector<c7x::TensorInfo> tensor_list(const JValue* v) {
  std::vector<c7x::TensorInfo> out;
  if (!v || v->kind != JValue::Arr) return out;
  for (auto& t : v->arr) {
    c7x::TensorInfo ti{};
    if (auto n = t.get("name")) ti.name = n->str;
    if (auto s = t.get("shape"))
      for (auto& d : s->arr) ti.shape.push_back(static_cast<int64_t>(d.num));
    ti.dtype = {kDLFloat, 32, 1};
    if (auto d = t.get("dtype")) parse_dtype(d->str, &ti.dtype);
    out.push_back(ti);
  }
  return out;
}

const char* errno_name(int rc) {
  switch (-rc) {
    case EFBIG: return "EFBIG";
    case EPERM: return "EPERM";
    case EINVAL: return "EINVAL";
    case ETIMEDOUT: return "ETIMEDOUT";
    case ECONNREFUSED: return "ECONNREFUSED";
    case ECONNRESET: return "ECONNRESET";
    case EPROTONOSUPPORT: return "EPROTONOSUPPORT";
    case EPROTO: return "EPROTO";
    case ENOMEM: return "ENOMEM";
    case ENOENT: return "ENOENT";
    case EMSGSIZE: return "EMSGSIZE";
    default: return "ERRNO";
  }
}

// "[2, 3, 4]", for an error message
std::string shape_text(const DLTensor* t) {
  std::string s = "[";
  for (int k = 0; k < t->ndim; k++) s += (k ? ", " : "") + std::to_string(t->shape[k]);
  return s + "]";
}

}  // namespace

namespace c7x {

DSPX_API Error::Error(int code, int32_t status, const std::string& message, uint64_t result_required,
                      uint32_t oom_requested, uint32_t oom_free, uint32_t oom_total)
    : std::runtime_error(message),
      code_(code),
      status_(status),
      result_required_(result_required),
      oom_requested_(oom_requested),
      oom_free_(oom_free),
      oom_total_(oom_total) {
  const char* n = status ? c7x_status_name(status) : nullptr;
  status_name_ = n ? n : errno_name(code);
}

DSPX_API Module::Module() = default;
DSPX_API Module::Module(const std::string& socket_path) { opts_.socket_path = socket_path; }
DSPX_API Module::Module(const ModuleOptions& opts) : opts_(opts) {}
DSPX_API Module::~Module() {
  try {
    Close();
  } catch (...) {
  }
}

void Module::Throw(int rc, const std::string& what) const {
  int32_t status = 0;
  uint64_t rr = 0;
  uint32_t oq = 0, of = 0, ot = 0;
  const char* detail = nullptr;
  if (client_) {
    status = c7x_client_last_status(client_);
    rr = c7x_client_result_required(client_);
    c7x_client_last_oom(client_, &oq, &of, &ot);
    detail = c7x_client_last_error(client_);
  } else {
    detail = c7x_client_open_error();
  }
  // a device failure's text already starts "ERR_SIZE (-7) on INFER: ..."; a host one gets its errno name
  std::string text = what + ": ";
  if (!status) text += std::string(errno_name(rc)) + " (" + std::to_string(rc) + ")" + (detail && *detail ? ": " : "");
  if (detail) text += detail;
  throw Error(rc, status, text, rr, oq, of, ot);
}

void Module::Open() {
  if (client_) return;
  c7x_client_opts_t o = C7X_CLIENT_OPTS_INIT;
  o.socket_path = opts_.socket_path.empty() ? nullptr : opts_.socket_path.c_str();
  o.timeout_ms = opts_.timeout_ms;
  o.printf_to_stderr = opts_.printf_to_stderr ? 1 : 0;
  int rc = c7x_client_open_ex(&client_, &o);
  if (rc) {
    client_ = nullptr;
    Throw(rc, "c7x::Module: open");
  }
}

DSPX_API void Module::Load(const std::string& dir_or_so) {
  if (loaded_) throw Error(-EINVAL, 0, "c7x::Module::Load: a module is already loaded; Close() it first");
  std::string so = dir_or_so;
  if (is_dir(dir_or_so)) so = dir_or_so + "/model.so";
  if (!is_file(so))
    throw Error(-ENOENT, 0, "c7x::Module::Load: no compiled module at " + so +
                                " (build one with `dspx compile MODEL.onnx -o DIR`)");
  std::string dir = parent_of(so);
  JValue meta;
  std::string meta_path = dir + "/metadata.json";
  if (is_file(meta_path)) {
    std::ifstream f(meta_path);
    std::stringstream ss;
    ss << f.rdbuf();
    std::string text = ss.str();
    try {
      meta = JParser(text).parse();
    } catch (const std::exception& e) {
      throw Error(-EINVAL, 0, e.what());
    }
  }
  Open();
  int rc = c7x_client_dyn_load_file(client_, so.c_str(), &info_);
  if (rc) Throw(rc, "c7x::Module::Load(" + so + ")");
  loaded_ = true;
  std::string wfile;
  if (auto w = meta.get("weights")) {
    if (auto f = w->get("file"))
      if (f->kind == JValue::Str) wfile = f->str;
  }
  if (wfile.empty())
    if (auto f = meta.get("weights_file"))
      if (f->kind == JValue::Str) wfile = f->str;
  if (!wfile.empty()) {
    std::string wpath = dir + "/" + wfile;
    rc = c7x_client_model_load_file(client_, wpath.c_str(), &model_id_, nullptr);
    if (rc) {
      std::string msg = "c7x::Module::Load: weights " + wpath;
      try {
        Throw(rc, msg);
      } catch (...) {
        c7x_client_dyn_unload(client_, info_.handle);
        loaded_ = false;
        throw;
      }
    }
  }
  if (auto r = meta.get("io_reserve")) {
    if (r->kind == JValue::Obj && !c7x_client_io_locked(client_)) {
      auto ib = r->get("input_bytes"), ob = r->get("output_bytes");
      ReserveIO(ib ? static_cast<size_t>(ib->num) : 0, ob ? static_cast<size_t>(ob->num) : 0);
    }
  }
  if (auto e = meta.get("entry"))
    if (e->kind == JValue::Str) entry_ = e->str;
  inputs_ = tensor_list(meta.get("inputs"));
  outputs_ = tensor_list(meta.get("outputs"));
}

DSPX_API void Module::ReserveIO(size_t input_bytes, size_t output_bytes) {
  Open();
  int rc = c7x_client_reserve_io(client_, input_bytes, output_bytes);
  if (rc) Throw(rc, "c7x::Module::ReserveIO");
}

DSPX_API DLTensor Module::CreateInput(const std::vector<int64_t>& shape, DLDataType dtype) {
  if (!loaded_) throw Error(-EINVAL, 0, "c7x::Module::CreateInput: no module loaded");
  if (dtype.lanes != 1) throw Error(-EINVAL, 0, "c7x::Module::CreateInput: lanes must be 1");
  c7x_tensor_desc_t d;
  int rc = c7x_client_create_input(client_, static_cast<int32_t>(shape.size()), shape.data(), dtype.code, dtype.bits,
                                   &d);
  if (rc) Throw(rc, "c7x::Module::CreateInput");
  input_shapes_.push_back(shape);
  DLTensor t{};
  t.data = d.data;
  t.device = {kDLCPU, 0};
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype = dtype;
  t.shape = input_shapes_.back().data();
  t.strides = nullptr;
  t.byte_offset = 0;
  return t;
}

DSPX_API const std::vector<OutputTensor>& Module::Run(const std::vector<DLTensor>& inputs, uint32_t flags) {
  std::vector<const DLTensor*> p;
  p.reserve(inputs.size());
  for (auto& t : inputs) p.push_back(&t);
  return Run(p, flags);
}

DSPX_API const std::vector<OutputTensor>& Module::Run(const std::vector<const DLTensor*>& inputs, uint32_t flags) {
  if (!loaded_) throw Error(-EINVAL, 0, "c7x::Module::Run: no module loaded");
  std::vector<c7x_tensor_desc_t> in(inputs.size());
  for (size_t i = 0; i < inputs.size(); i++) {
    const DLTensor* t = inputs[i];
    std::string where = "c7x::Module::Run: input " + std::to_string(i);
    if (!t) throw Error(-EINVAL, 0, where + " is null");
    if (t->device.device_type != kDLCPU && t->device.device_type != kDLCUDAHost)
      throw Error(-EINVAL, 0, where + " is not in host memory");
    if (t->dtype.lanes != 1) throw Error(-EINVAL, 0, where + ": lanes must be 1");
    if (t->ndim < 0 || t->ndim > C7X_MAX_NDIM) throw Error(-EINVAL, 0, where + ": ndim outside 0..6");
    // the C client's guard: a shape whose size wraps would send a small tensor
    int64_t nbytes = dspx_shape_bytes(t->ndim, t->shape, t->dtype.bits);
    if (nbytes < 0)
      throw Error(-EINVAL, 0, where + ": bad shape " + shape_text(t) + " (a negative extent, or 2^60 elements or more)");
    // strides matter only when there are elements; then every partial product is below 2^60
    int64_t expect = 1;
    for (int k = t->ndim - 1; k >= 0 && nbytes; k--) {
      if (t->strides && t->shape[k] != 1 && t->strides[k] != expect)
        throw Error(-EINVAL, 0, where + " is not compact row-major (pass a contiguous tensor)");
      expect *= t->shape[k];
    }
    c7x_tensor_desc_t& d = in[i];
    std::memset(&d, 0, sizeof d);
    d.data = static_cast<uint8_t*>(t->data) + t->byte_offset;
    d.data_size = static_cast<size_t>(nbytes);
    d.ndim = t->ndim;
    d.dtype_code = t->dtype.code;
    d.dtype_bits = t->dtype.bits;
    for (int k = 0; k < t->ndim; k++) d.shape[k] = t->shape[k];
  }
  size_t cap = outputs_.size();
  if (info_.io_num_outputs > cap) cap = info_.io_num_outputs;
  if (cap < 16) cap = 16;
  std::vector<c7x_tensor_desc_t> outs(cap);
  c7x_infer_info_t ii;
  int rc = c7x_client_infer(client_, info_.handle, model_id_, in.data(), static_cast<uint32_t>(in.size()), outs.data(),
                            static_cast<uint32_t>(cap), flags, &ii);
  last_printf_ = c7x_client_printf_text(client_);
  if (rc) Throw(rc, "c7x::Module::Run");
  last_cycles_ = ii.cycles;
  if (ii.num_outputs > cap) {
    outs.resize(ii.num_outputs);
    throw Error(-ENOBUFS, 0, "c7x::Module::Run: module returned " + std::to_string(ii.num_outputs) + " outputs");
  }
  out_.assign(ii.num_outputs, OutputTensor{});
  out_shapes_.assign(ii.num_outputs, std::vector<int64_t>());
  for (uint32_t i = 0; i < ii.num_outputs; i++) {
    const c7x_tensor_desc_t& d = outs[i];
    out_shapes_[i].assign(d.shape, d.shape + (d.ndim < 0 ? 0 : d.ndim > 6 ? 6 : d.ndim));
    OutputTensor& o = out_[i];
    o.dl.data = d.data;
    o.dl.device = {kDLCPU, 0};
    o.dl.ndim = d.ndim;
    o.dl.dtype = {static_cast<uint8_t>(d.dtype_code), static_cast<uint8_t>(d.dtype_bits), 1};
    o.dl.shape = out_shapes_[i].data();
    o.dl.strides = nullptr;
    o.dl.byte_offset = 0;
    o.nbytes = d.data_size;
    o.name = i < outputs_.size() ? outputs_[i].name : "";
  }
  return out_;
}

DSPX_API void Module::Close() {
  out_.clear();
  out_shapes_.clear();
  if (client_) {
    if (loaded_) {
      if (model_id_) c7x_client_model_unload(client_, model_id_);
      c7x_client_dyn_unload(client_, info_.handle);
    }
    c7x_client_close(client_);
    client_ = nullptr;
  }
  input_shapes_.clear();
  loaded_ = false;
  model_id_ = 0;
}

}  // namespace c7x
