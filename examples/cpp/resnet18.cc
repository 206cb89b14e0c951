// ResNet-18 through c7x::Module on DLPack tensors (the seed's C++ API).
//
//   dspx compile resnet18.onnx -o build/resnet18       # or the example module the tests build
//   dspx serve &
//   c++ -std=c++17 resnet18.cc $(dspx sdk --cflags --libs) -o resnet18
//   ./resnet18 build/resnet18 input.bin logits.bin     # raw float32 in, raw float32 out
//
// It runs the model twice: once on a tensor in the program's own memory (one
// copy into input_buf) and once on a tensor made by CreateInput (in
// input_buf already: no copy), checks both give the same logits, writes them
// and prints the top 5 and the device's cycle count.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "c7x_runtime.h"

static size_t elements(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s MODULE_DIR INPUT.bin OUTPUT.bin\n", argv[0]);
    return 64;
  }
  try {
    c7x::Module m;
    m.Load(argv[1]);
    if (m.inputs().size() != 1 || m.outputs().size() != 1) {
      std::fprintf(stderr, "expected one input and one output, metadata.json has %zu / %zu\n", m.inputs().size(),
                   m.outputs().size());
      return 1;
    }
    const c7x::TensorInfo& in = m.inputs()[0];
    std::vector<int64_t> shape = in.shape;
    size_t n = elements(shape);

    std::vector<float> x(n);
    std::ifstream f(argv[2], std::ios::binary);
    if (!f.read(reinterpret_cast<char*>(x.data()), static_cast<std::streamsize>(n * sizeof(float)))) {
      std::fprintf(stderr, "%s: need %zu float32 values\n", argv[2], n);
      return 1;
    }

    // 1. a tensor in our own memory: copied once into input_buf
    DLTensor t{};
    t.data = x.data();
    t.device = {kDLCPU, 0};
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = {kDLFloat, 32, 1};
    t.shape = shape.data();
    const std::vector<c7x::OutputTensor>& out = m.Run({t});
    const c7x::OutputTensor& logits = out.at(0);
    size_t nout = logits.nbytes / sizeof(float);
    // out[0].dl.data lives in output_buf until the next Run: keep a copy
    std::vector<float> y(static_cast<const float*>(logits.dl.data), static_cast<const float*>(logits.dl.data) + nout);
    uint64_t cycles = m.last_cycles();

    // 2. zero copy: the input lives in input_buf
    DLTensor xin = m.CreateInput(shape, {kDLFloat, 32, 1});
    std::memcpy(xin.data, x.data(), n * sizeof(float));
    const std::vector<c7x::OutputTensor>& out2 = m.Run({xin});
    const float* y2 = static_cast<const float*>(out2.at(0).dl.data);
    if (std::memcmp(y.data(), y2, nout * sizeof(float)) != 0) {
      std::fprintf(stderr, "zero-copy run differs from the copying run\n");
      return 1;
    }

    std::ofstream o(argv[3], std::ios::binary);
    o.write(reinterpret_cast<const char*>(y.data()), static_cast<std::streamsize>(nout * sizeof(float)));
    if (!o) {
      std::fprintf(stderr, "cannot write %s\n", argv[3]);
      return 1;
    }

    std::vector<size_t> idx(nout);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + 5, idx.end(), [&](size_t a, size_t b) { return y[a] > y[b]; });
    std::printf("%s: output %s shape [", argv[1], logits.name.c_str());
    for (int i = 0; i < logits.dl.ndim; i++) std::printf("%s%lld", i ? ", " : "", (long long)logits.dl.shape[i]);
    std::printf("], %llu cycles\ntop-5:", (unsigned long long)cycles);
    for (int i = 0; i < 5; i++) std::printf(" %zu (%.4f)", idx[i], y[idx[i]]);
    std::printf("\n");
    m.Close();
  } catch (const c7x::Error& e) {
    std::fprintf(stderr, "c7x::Error %s (code %d, status %d): %s\n", e.status_name().c_str(), e.code(), e.status(),
                 e.what());
    return 2;
  }
  return 0;
}
