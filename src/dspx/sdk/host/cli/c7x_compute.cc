// c7x_compute — the TI-shaped command line over libdspx (c7x_client / c7x::Module).
//
//   c7x_compute ping [--count N]              round trips: median / min µs, device version
//   c7x_compute status                        uptime, jobs, pools
//   c7x_compute run DIR_OR_SO --input X.bin [--input ...] [--output PREFIX] [--repeat N]
//       load + infer + unload in one connection; inputs are raw bytes in
//       metadata.json's order, outputs go to PREFIX<i>.bin
//
// Every command prints one JSON line; errors print {"error": ..., "status": ...} and exit 1.
// The device comes from --socket, $DSPX_SOCKET or the per-user socket (`dspx serve`).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "c7x_client.h"
#include "c7x_runtime.h"

namespace {

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char ch : s) {
    unsigned char c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      o += '\\';
      o += ch;
    } else if (c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
    } else {
      o += ch;
    }
  }
  return o + "\"";
}

int fail(const std::string& what, int32_t status = 0, int code = 0) {
  std::printf("{\"error\": %s, \"status\": %s, \"code\": %d}\n", json_str(what).c_str(),
              json_str(status ? c7x_status_name(status) : "").c_str(), code);
  return 1;
}

const char* dtype_name(const DLDataType& t) {
  static const char* ints[] = {"int8", "int16", "int32", "int64"};
  static const char* uints[] = {"uint8", "uint16", "uint32", "uint64"};
  static const char* floats[] = {"?", "float16", "float32", "float64"};
  int k = t.bits == 8 ? 0 : t.bits == 16 ? 1 : t.bits == 32 ? 2 : t.bits == 64 ? 3 : -1;
  if (k < 0) return "?";
  return t.code == kDLInt ? ints[k] : t.code == kDLUInt ? uints[k] : t.code == kDLFloat ? floats[k] : "?";
}

int cmd_ping(const std::string& sock, int count) {
  c7x_client_t* c = nullptr;
  int rc = c7x_client_open(&c, sock.empty() ? nullptr : sock.c_str());
  if (rc) return fail(c7x_client_open_error(), 0, rc);
  std::vector<double> us;
  uint32_t version = 0;
  for (int i = 0; i < count; i++) {
    auto t0 = std::chrono::steady_clock::now();
    rc = c7x_client_ping(c, &version, nullptr);
    auto t1 = std::chrono::steady_clock::now();
    if (rc) {
      int r = fail(c7x_client_last_error(c), c7x_client_last_status(c), rc);
      c7x_client_close(c);
      return r;
    }
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  c7x_client_close(c);
  std::sort(us.begin(), us.end());
  std::printf("{\"version\": \"%u.%u.%u\", \"count\": %d, \"median_us\": %.2f, \"min_us\": %.2f}\n",
              (version >> 16) & 0xFF, (version >> 8) & 0xFF, version & 0xFF, count, us[us.size() / 2], us[0]);
  return 0;
}

int cmd_status(const std::string& sock) {
  c7x_client_t* c = nullptr;
  int rc = c7x_client_open(&c, sock.empty() ? nullptr : sock.c_str());
  if (rc) return fail(c7x_client_open_error(), 0, rc);
  c7x_status_t st;
  c7x_pool_status_t ps;
  rc = c7x_client_status(c, &st);
  if (!rc) rc = c7x_client_pool_status(c, &ps);
  if (rc) {
    int r = fail(c7x_client_last_error(c), c7x_client_last_status(c), rc);
    c7x_client_close(c);
    return r;
  }
  c7x_client_close(c);
  std::printf(
      "{\"version\": \"%u.%u.%u\", \"uptime_ms\": %u, \"jobs_completed\": %u, \"jobs_failed\": %u, "
      "\"ddr_total\": %llu, \"ddr_used\": %llu, \"carveout_total\": %llu, \"carveout_used\": %llu, "
      "\"connections\": %u, \"modules\": %u, \"cores\": %u, \"op_count\": %u}\n",
      (st.version >> 16) & 0xFF, (st.version >> 8) & 0xFF, st.version & 0xFF, st.uptime_ms, st.jobs_completed,
      st.jobs_failed, (unsigned long long)ps.ddr_total, (unsigned long long)ps.ddr_used,
      (unsigned long long)ps.carveout_total, (unsigned long long)ps.carveout_used, ps.connections, ps.modules,
      ps.cores, ps.op_count);
  return 0;
}

int cmd_run(const std::string& sock, const std::string& module, const std::vector<std::string>& inputs,
            const std::string& prefix, int repeat) {
  try {
    auto t0 = std::chrono::steady_clock::now();
    c7x::Module m(sock);
    m.Load(module);
    auto t1 = std::chrono::steady_clock::now();
    if (inputs.size() != m.inputs().size())
      return fail("the module takes " + std::to_string(m.inputs().size()) + " inputs, got " +
                  std::to_string(inputs.size()) + " --input files");
    std::vector<std::vector<char>> data(inputs.size());
    std::vector<DLTensor> ts(inputs.size());
    std::vector<std::vector<int64_t>> shapes(inputs.size());
    for (size_t i = 0; i < inputs.size(); i++) {
      const c7x::TensorInfo& ti = m.inputs()[i];
      size_t n = 1;
      for (int64_t d : ti.shape) n *= static_cast<size_t>(d);
      size_t bytes = n * ti.dtype.bits / 8;
      std::ifstream f(inputs[i], std::ios::binary);
      data[i].resize(bytes);
      if (!f.read(data[i].data(), static_cast<std::streamsize>(bytes)))
        return fail(inputs[i] + ": needs " + std::to_string(bytes) + " bytes for input " + ti.name);
      shapes[i] = ti.shape;
      ts[i] = DLTensor{data[i].data(), {kDLCPU, 0}, static_cast<int32_t>(ti.shape.size()), ti.dtype,
                       shapes[i].data(), nullptr, 0};
    }
    const std::vector<c7x::OutputTensor>& out = m.Run(ts, C7X_INFER_REPEAT(repeat));
    auto t2 = std::chrono::steady_clock::now();
    std::ostringstream js;
    js << "{\"module\": " << json_str(module) << ", \"cycles\": " << m.last_cycles() << ", \"outputs\": [";
    for (size_t i = 0; i < out.size(); i++) {
      std::string path = prefix + std::to_string(i) + ".bin";
      if (!prefix.empty()) {
        std::ofstream f(path, std::ios::binary);
        f.write(static_cast<const char*>(out[i].dl.data), static_cast<std::streamsize>(out[i].nbytes));
        if (!f) return fail("cannot write " + path);
      }
      js << (i ? ", " : "") << "{\"name\": " << json_str(out[i].name) << ", \"dtype\": \"" << dtype_name(out[i].dl.dtype)
         << "\", \"shape\": [";
      for (int k = 0; k < out[i].dl.ndim; k++) js << (k ? ", " : "") << out[i].dl.shape[k];
      js << "]" << (prefix.empty() ? "" : ", \"file\": " + json_str(path)) << "}";
    }
    m.Close();
    auto t3 = std::chrono::steady_clock::now();
    auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
    js << "], \"load_ms\": " << ms(t0, t1) << ", \"infer_ms\": " << ms(t1, t2) << ", \"unload_ms\": " << ms(t2, t3)
       << "}";
    std::printf("%s\n", js.str().c_str());
    return 0;
  } catch (const c7x::Error& e) {
    return fail(e.what(), e.status(), e.code());
  }
}

int usage() {
  std::fprintf(stderr,
               "usage: c7x_compute [--socket PATH] ping [--count N]\n"
               "       c7x_compute [--socket PATH] status\n"
               "       c7x_compute [--socket PATH] run DIR_OR_SO --input X.bin [...] [--output PREFIX] [--repeat N]\n");
  return 64;
}

}  // namespace

int main(int argc, char** argv) {
  std::string sock, cmd, module, prefix;
  std::vector<std::string> inputs;
  int count = 10, repeat = 0;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        usage();
        std::exit(64);
      }
      return argv[++i];
    };
    if (a == "--socket") sock = next();
    else if (a == "--count") count = std::atoi(next().c_str());
    else if (a == "--input") inputs.push_back(next());
    else if (a == "--output") prefix = next();
    else if (a == "--repeat") repeat = std::atoi(next().c_str());
    else if (a == "-h" || a == "--help") return usage();
    else if (cmd.empty()) cmd = a;
    else if (cmd == "run" && module.empty()) module = a;
    else return usage();
  }
  if (cmd == "ping") return cmd_ping(sock, count > 0 ? count : 1);
  if (cmd == "status") return cmd_status(sock);
  if (cmd == "run" && !module.empty()) return cmd_run(sock, module, inputs, prefix, repeat);
  return usage();
}
