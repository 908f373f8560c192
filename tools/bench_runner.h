// The measurements behind `deltasync bench` (README.md, "Diff and
// encodings"): memcpy, the fused diff and every delta encoding, timed side by
// side on the same in-memory synthetic RL step, because on shared machines
// only ratios taken in one run mean anything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/codec.h"
#include "deltasync/status.h"

namespace deltasync::cli {

struct BenchConfig {
  std::string preset = "qwen2.5-0.5b";
  uint64_t target_bytes = uint64_t{512} << 20;  // BF16 bytes of the model
  double lr = 1e-6;
  uint64_t seed = 0;
  // Optimiser steps before the measured pair: the very first AdamW steps
  // change more elements than a run in progress does.
  int64_t warmup_steps = 2;
  size_t threads = 1;               // N for the "_nt" figures; >= 1
  int repeat = 3;                   // each figure is the best (shortest) of this many runs; >= 1
  std::vector<Encoding> encodings;  // measured in this order; empty = none
};

// Wall-clock seconds of one operation over the whole model, best of
// BenchConfig::repeat runs. `nt` is at BenchConfig::threads threads.
struct BenchTiming {
  double seconds_1t = 0;
  double seconds_nt = 0;
};

struct BenchEncodingResult {
  Encoding encoding = Encoding::kDense;
  BenchTiming encode;
  BenchTiming decode_apply;
  uint64_t encoded_bytes = 0;  // all tensors' encodings together
  // xor only: the same XOR images compressed by one-shot zstd at level 1,
  // as the Python peers write the xor format (our encoder makes smaller
  // frames of the same format); 0 for other encodings.
  uint64_t zstd1_bytes = 0;
  // Tensors encoded: all of them for dense, only those with a changed
  // element for the delta encodings (a publisher omits the others).
  size_t tensors = 0;
};

struct BenchResult {
  double scale = 0;          // SynthScaleForBytes of the requested size
  uint64_t dense_bytes = 0;  // BF16 bytes of every tensor: the figures' numerator
  uint64_t numel = 0;        // elements over all tensors
  uint64_t changed = 0;      // elements whose bits differ between old and new
  size_t tensors = 0;
  std::string diff_kernel;  // DiffKernelName of the kernel timed
  BenchTiming memcpy_time;
  BenchTiming diff_time;
  double entropy_bytes = 0;  // EntropyBound::total_bytes summed over tensors
  std::vector<BenchEncodingResult> encodings;

  double density() const { return numel ? static_cast<double>(changed) / numel : 0.0; }
  // Dense bytes per second, in GB/s (1e9 bytes).
  double Gbps(double seconds) const { return seconds > 0 ? dense_bytes / seconds / 1e9 : 0.0; }
  double BytesPerChanged(double bytes) const { return changed ? bytes / changed : 0.0; }
  // nullptr when `encoding` was not measured.
  const BenchEncodingResult* Find(Encoding encoding) const;
};

// Receives one short line per phase (for a terminal's progress display).
using BenchProgress = std::function<void(std::string_view)>;

// Builds the synthetic step pair and runs every measurement of `config`.
// Every decode-apply is checked to reproduce the new weights exactly, every
// timed diff to refresh the snapshot to them and to find the same changes as
// the untimed reference diff, and multi-threaded encodings to equal the
// single-threaded ones byte for byte; a failed check is an Internal error
// naming the encoding and tensor. Other errors: InvalidArgument (bad config,
// unknown preset), OutOfRange (size beyond the preset or memory), and any
// error of the codec.
Result<BenchResult> RunBench(const BenchConfig& config, const BenchProgress& progress = {});

// The "model name" of the first processor in /proc/cpuinfo, or "unknown".
std::string CpuModelName();

}  // namespace deltasync::cli
