#include "bench_runner.h"

#include <zstd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <new>
#include <span>

#include "deltasync/diff.h"
#include "deltasync/dtype.h"
#include "deltasync/synth.h"
#include "deltasync/thread_pool.h"

namespace deltasync::cli {
namespace {

using Clock = std::chrono::steady_clock;

// An empty asm statement that claims to read `p` and clobber memory: the
// compiler must then assume the bytes behind `p` are used, so it cannot drop
// or sink the stores of a timed region past the clock read.
inline void KeepMemory(const void* p) { asm volatile("" : : "r"(p) : "memory"); }

// Times `fn` (which returns Status) and keeps the shortest run in *best.
template <typename Fn>
Status TimeBest(Fn&& fn, const void* written, double* best) {
  const Clock::time_point start = Clock::now();
  Status status = fn();
  KeepMemory(written);
  const Clock::time_point end = Clock::now();
  DS_RETURN_IF_ERROR(status);
  *best = std::min(*best, std::chrono::duration<double>(end - start).count());
  return Status::OK();
}

// Cache-line aligned heap bytes, touched once at allocation so that
// first-touch page faults never land inside a timed region.
class AlignedBuffer {
 public:
  static Result<AlignedBuffer> Allocate(size_t size, std::string_view what) {
    AlignedBuffer buffer;
    buffer.bytes_.reset(new (std::align_val_t{kAlignment}, std::nothrow) uint8_t[size]);
    if (!buffer.bytes_) {
      return Status::OutOfRange("cannot allocate " + std::to_string(size) + " bytes for the " +
                                std::string(what));
    }
    std::memset(buffer.bytes_.get(), 0, size);
    buffer.size_ = size;
    return buffer;
  }

  uint8_t* data() const { return bytes_.get(); }
  size_t size() const { return size_; }

  static constexpr size_t kAlignment = 64;

 private:
  struct Free {
    void operator()(uint8_t* p) const { ::operator delete[](p, std::align_val_t{kAlignment}); }
  };
  std::unique_ptr<uint8_t[], Free> bytes_;
  size_t size_ = 0;
};

// Where one tensor lives inside each of the same-layout arenas.
struct BenchTensor {
  std::string name;
  size_t offset = 0;
  size_t nbytes = 0;
  uint32_t elem_size = 2;
};

bool SameChanges(const ChangeSet& a, const ChangeSet& b) {
  return a.numel == b.numel && a.elem_size == b.elem_size && a.wide == b.wide &&
         a.pos32 == b.pos32 && a.pos64 == b.pos64 && a.new_values == b.new_values &&
         a.old_values == b.old_values;
}

class BenchRun {
 public:
  BenchRun(const BenchConfig& config, const BenchProgress& progress)
      : config_(config), progress_(progress) {}

  Result<BenchResult> Run() {
    if (config_.threads == 0) return Status::InvalidArgument("--threads must be at least 1");
    if (config_.repeat < 1) return Status::InvalidArgument("--repeat must be at least 1");
    if (config_.warmup_steps < 0) {
      return Status::InvalidArgument("--warmup-steps must not be negative");
    }
    if (config_.threads > 1) pool_ = std::make_unique<ThreadPool>(config_.threads - 1);
    DS_RETURN_IF_ERROR(MakeStepPair());
    DS_ASSIGN_OR_RETURN(work_, AlignedBuffer::Allocate(arena_bytes_, "snapshot"));
    DS_RETURN_IF_ERROR(ReferenceDiff());
    DS_RETURN_IF_ERROR(MeasureCopyAndDiff());
    for (Encoding encoding : config_.encodings) DS_RETURN_IF_ERROR(MeasureEncoding(encoding));
    return std::move(result_);
  }

 private:
  std::span<const uint8_t> OldBytes(size_t t) const {
    return {old_.data() + tensors_[t].offset, tensors_[t].nbytes};
  }
  std::span<const uint8_t> NewBytes(size_t t) const {
    return {new_.data() + tensors_[t].offset, tensors_[t].nbytes};
  }
  std::span<uint8_t> WorkBytes(size_t t) const {
    return {work_.data() + tensors_[t].offset, tensors_[t].nbytes};
  }

  void Progress(const std::string& line) const {
    if (progress_) progress_(line);
  }

  // Runs fn(i) for i in [0, n): on the pool when `parallel` and there is one.
  void ForEach(size_t n, bool parallel, const std::function<void(size_t)>& fn) const {
    if (parallel && pool_) {
      pool_->ParallelFor(n, fn);
    } else {
      for (size_t i = 0; i < n; ++i) fn(i);
    }
  }

  static Status FirstError(const std::vector<Status>& statuses) {
    for (const Status& s : statuses) DS_RETURN_IF_ERROR(s);
    return Status::OK();
  }

  void RestoreWorkToOld() const { std::memcpy(work_.data(), old_.data(), arena_bytes_); }

  // Internal error naming the first tensor whose work bytes differ from new.
  Status CheckWorkEqualsNew(std::string_view what) const {
    for (size_t t = 0; t < tensors_.size(); ++t) {
      if (std::memcmp(WorkBytes(t).data(), NewBytes(t).data(), tensors_[t].nbytes) != 0) {
        return Status::Internal(std::string(what) +
                                " did not reproduce the new weights of tensor " + tensors_[t].name);
      }
    }
    return Status::OK();
  }

  // Trains the synthetic model to the measured step and keeps only its BF16
  // weights before and after it, so the trainer's 14 bytes per parameter are
  // gone before anything is timed.
  Status MakeStepPair() {
    DS_ASSIGN_OR_RETURN(result_.scale, SynthScaleForBytes(config_.preset, config_.target_bytes));
    SynthConfig synth;
    synth.preset = config_.preset;
    synth.scale = result_.scale;
    synth.seed = config_.seed;
    synth.lr = config_.lr;
    synth.num_threads = config_.threads;
    Progress("building " + config_.preset + " at scale " + std::to_string(result_.scale));
    DS_ASSIGN_OR_RETURN(std::unique_ptr<SynthTrainer> trainer, SynthTrainer::Create(synth));

    const std::vector<TensorView> initial = trainer->Weights();
    arena_bytes_ = 0;
    for (const TensorView& w : initial) {
      const size_t elem_size = DTypeSize(w.dtype);
      if (elem_size != 1 && elem_size != 2 && elem_size != 4 && elem_size != 8) {
        return Status::Unsupported("tensor " + w.name + " has an element size of " +
                                   std::to_string(elem_size) + " bytes");
      }
      BenchTensor t{w.name, arena_bytes_, w.nbytes(), static_cast<uint32_t>(elem_size)};
      tensors_.push_back(t);
      arena_bytes_ += (w.nbytes() + AlignedBuffer::kAlignment - 1) / AlignedBuffer::kAlignment *
                      AlignedBuffer::kAlignment;
      result_.dense_bytes += w.nbytes();
      result_.numel += w.nbytes() / elem_size;
    }
    result_.tensors = tensors_.size();
    if (arena_bytes_ == 0) return Status::InvalidArgument("the synthetic model has no bytes");
    DS_ASSIGN_OR_RETURN(old_, AlignedBuffer::Allocate(arena_bytes_, "old weights"));
    DS_ASSIGN_OR_RETURN(new_, AlignedBuffer::Allocate(arena_bytes_, "new weights"));

    for (int64_t step = 1; step <= config_.warmup_steps; ++step) {
      Progress("warm-up step " + std::to_string(step) + "/" + std::to_string(config_.warmup_steps));
      trainer->Step();
    }
    DS_RETURN_IF_ERROR(CopyWeights(*trainer, old_));
    Progress("measured step");
    trainer->Step();
    DS_RETURN_IF_ERROR(CopyWeights(*trainer, new_));
    trainer_changed_ = static_cast<uint64_t>(trainer->last_step_stats().changed_elements);

    // Largest first, so that a dynamic parallel-for ends with the small
    // tensors and its threads finish together.
    by_size_.resize(tensors_.size());
    for (size_t t = 0; t < tensors_.size(); ++t) by_size_[t] = t;
    std::stable_sort(by_size_.begin(), by_size_.end(),
                     [&](size_t a, size_t b) { return tensors_[a].nbytes > tensors_[b].nbytes; });
    return Status::OK();
  }

  Status CopyWeights(const SynthTrainer& trainer, const AlignedBuffer& into) const {
    const std::vector<TensorView> weights = trainer.Weights();
    if (weights.size() != tensors_.size()) {
      return Status::Internal("the trainer's tensor list changed between steps");
    }
    for (size_t t = 0; t < weights.size(); ++t) {
      if (weights[t].nbytes() != tensors_[t].nbytes) {
        return Status::Internal("tensor " + tensors_[t].name + " changed size between steps");
      }
      std::memcpy(into.data() + tensors_[t].offset, weights[t].bytes.data(), tensors_[t].nbytes);
    }
    return Status::OK();
  }

  Status DiffAll(ThreadPool* pool, std::vector<ChangeSet>* changes) const {
    DiffOptions options;
    options.refresh_snapshot = true;
    options.keep_old_values = true;
    options.kernel = kernel_;
    options.pool = pool;
    for (size_t t = 0; t < tensors_.size(); ++t) {
      options.elem_size = tensors_[t].elem_size;
      DS_RETURN_IF_ERROR(DiffTensor(NewBytes(t), WorkBytes(t), options, &(*changes)[t])
                             .WithContext("diff of " + tensors_[t].name));
    }
    return Status::OK();
  }

  // The untimed diff whose ChangeSets every encoder reads, checked against
  // the trainer's own count of changed elements.
  Status ReferenceDiff() {
    kernel_ = BestDiffKernel();
    result_.diff_kernel = std::string(DiffKernelName(kernel_));
    changes_.resize(tensors_.size());
    scratch_changes_.resize(tensors_.size());
    RestoreWorkToOld();
    DS_RETURN_IF_ERROR(DiffAll(nullptr, &changes_));
    DS_RETURN_IF_ERROR(CheckWorkEqualsNew("the reference diff's snapshot refresh"));
    for (const ChangeSet& c : changes_) {
      result_.changed += c.count();
      if (c.count() == 0) continue;
      DS_ASSIGN_OR_RETURN(EntropyBound bound, EntropyBoundBytes(c));
      result_.entropy_bytes += bound.total_bytes();
    }
    if (result_.changed != trainer_changed_) {
      return Status::Internal("the diff found " + std::to_string(result_.changed) +
                              " changed elements but the trainer reports " +
                              std::to_string(trainer_changed_));
    }
    // Copy work in pieces no larger than the diff's parallel chunks, so the
    // multi-threaded memcpy splits the model the way the diff does.
    const size_t chunk = DiffOptions{}.parallel_chunk_bytes;
    for (const BenchTensor& t : tensors_) {
      for (size_t at = 0; at < t.nbytes; at += chunk) {
        copy_pieces_.push_back({t.offset + at, std::min(chunk, t.nbytes - at)});
      }
    }
    return Status::OK();
  }

  Status MeasureCopyAndDiff() {
    constexpr double kInf = std::numeric_limits<double>::infinity();
    double memcpy_1t = kInf, memcpy_nt = kInf, diff_1t = kInf, diff_nt = kInf;
    auto copy_all = [&](bool parallel) {
      ForEach(copy_pieces_.size(), parallel, [&](size_t i) {
        std::memcpy(work_.data() + copy_pieces_[i].offset, new_.data() + copy_pieces_[i].offset,
                    copy_pieces_[i].bytes);
      });
      return Status::OK();
    };
    // One round measures everything once, so that a noisy neighbour slows
    // all figures of a round alike and the ratios stay meaningful.
    for (int r = 0; r < config_.repeat; ++r) {
      Progress("memcpy and diff, round " + std::to_string(r + 1) + "/" +
               std::to_string(config_.repeat));
      DS_RETURN_IF_ERROR(TimeBest([&] { return copy_all(false); }, work_.data(), &memcpy_1t));
      DS_RETURN_IF_ERROR(CheckWorkEqualsNew("memcpy"));
      DS_RETURN_IF_ERROR(TimeBest([&] { return copy_all(true); }, work_.data(), &memcpy_nt));
      DS_RETURN_IF_ERROR(CheckWorkEqualsNew("multi-threaded memcpy"));
      // Single thread, then N threads (the same single-threaded pass when N is 1).
      for (int pass = 0; pass < 2; ++pass) {
        ThreadPool* pool = pass == 0 ? nullptr : pool_.get();
        RestoreWorkToOld();
        DS_RETURN_IF_ERROR(TimeBest([&] { return DiffAll(pool, &scratch_changes_); }, work_.data(),
                                    pass == 0 ? &diff_1t : &diff_nt));
        DS_RETURN_IF_ERROR(CheckWorkEqualsNew("the diff's snapshot refresh"));
        for (size_t t = 0; t < tensors_.size(); ++t) {
          if (!SameChanges(scratch_changes_[t], changes_[t])) {
            return Status::Internal("the timed diff of " + tensors_[t].name +
                                    " differs from the reference diff");
          }
        }
      }
    }
    result_.memcpy_time = {memcpy_1t, memcpy_nt};
    result_.diff_time = {diff_1t, diff_nt};
    return Status::OK();
  }

  // Bytes of tensor t's XOR image compressed as the Python peers compress
  // it: one-shot zstd, level 1.
  Result<size_t> Zstd1XorBytes(size_t t) const {
    const std::span<const uint8_t> old_bytes = OldBytes(t);
    const std::span<const uint8_t> new_bytes = NewBytes(t);
    std::vector<uint8_t> image(new_bytes.size());
    for (size_t i = 0; i < image.size(); ++i) image[i] = old_bytes[i] ^ new_bytes[i];
    std::vector<uint8_t> frame(ZSTD_compressBound(image.size()));
    const size_t n = ZSTD_compress(frame.data(), frame.size(), image.data(), image.size(), 1);
    if (ZSTD_isError(n)) {
      return Status::Internal("zstd -1 of the XOR image of " + tensors_[t].name + ": " +
                              ZSTD_getErrorName(n));
    }
    return n;
  }

  Status MeasureEncoding(Encoding encoding) {
    const std::string name(EncodingName(encoding));
    Progress("encoding " + name);
    // A publisher ships only changed tensors as deltas; dense ships all.
    std::vector<size_t> included;
    for (size_t t : by_size_) {
      if (encoding == Encoding::kDense || changes_[t].count() > 0) included.push_back(t);
    }
    const EncodeOptions encode_options;
    std::vector<std::vector<uint8_t>> reference(tensors_.size()), scratch(tensors_.size());
    BenchEncodingResult out;
    out.encoding = encoding;
    out.tensors = included.size();
    for (size_t t : included) {
      DS_RETURN_IF_ERROR(Encode(encoding, NewBytes(t), changes_[t], encode_options, &reference[t])
                             .WithContext(name + " encoding of " + tensors_[t].name));
      out.encoded_bytes += reference[t].size();
      if (encoding == Encoding::kXor) {
        DS_ASSIGN_OR_RETURN(const size_t peer, Zstd1XorBytes(t));
        out.zstd1_bytes += peer;
      }
      // Sized (and so paged in) now, so timed encodes never grow a buffer.
      scratch[t].resize(reference[t].size());
    }

    std::vector<Status> statuses(tensors_.size());
    auto encode_all = [&](bool parallel) {
      ForEach(included.size(), parallel, [&](size_t i) {
        const size_t t = included[i];
        scratch[t].clear();
        statuses[t] = Encode(encoding, NewBytes(t), changes_[t], encode_options, &scratch[t]);
      });
      return FirstError(statuses);
    };
    auto check_encoded = [&](std::string_view how) -> Status {
      for (size_t t : included) {
        if (scratch[t] != reference[t]) {
          return Status::Internal(std::string(how) + " " + name + " encoding of " +
                                  tensors_[t].name + " differs from the reference encoding");
        }
      }
      return Status::OK();
    };
    auto decode_all = [&](bool parallel) {
      ForEach(included.size(), parallel, [&](size_t i) {
        const size_t t = included[i];
        statuses[t] = DecodeApply(encoding, reference[t], WorkBytes(t), tensors_[t].elem_size);
      });
      return FirstError(statuses);
    };

    constexpr double kInf = std::numeric_limits<double>::infinity();
    double encode_1t = kInf, encode_nt = kInf, decode_1t = kInf, decode_nt = kInf;
    for (int r = 0; r < config_.repeat; ++r) {
      Progress(name + ", round " + std::to_string(r + 1) + "/" + std::to_string(config_.repeat));
      for (int pass = 0; pass < 2; ++pass) {
        const bool parallel = pass == 1;
        DS_RETURN_IF_ERROR(TimeBest([&] { return encode_all(parallel); }, scratch.data(),
                                    parallel ? &encode_nt : &encode_1t)
                               .WithContext(name + " encode"));
        DS_RETURN_IF_ERROR(check_encoded(parallel ? "the multi-threaded" : "the timed"));
      }
      for (int pass = 0; pass < 2; ++pass) {
        const bool parallel = pass == 1;
        RestoreWorkToOld();
        DS_RETURN_IF_ERROR(TimeBest([&] { return decode_all(parallel); }, work_.data(),
                                    parallel ? &decode_nt : &decode_1t)
                               .WithContext(name + " decode-apply"));
        DS_RETURN_IF_ERROR(
            CheckWorkEqualsNew((parallel ? "multi-threaded " : "") + name + " decode-apply"));
      }
    }
    out.encode = {encode_1t, encode_nt};
    out.decode_apply = {decode_1t, decode_nt};
    result_.encodings.push_back(out);
    return Status::OK();
  }

  struct CopyPiece {
    size_t offset = 0;
    size_t bytes = 0;
  };

  const BenchConfig& config_;
  const BenchProgress& progress_;
  std::unique_ptr<ThreadPool> pool_;  // threads - 1 workers: the caller is the Nth
  std::vector<BenchTensor> tensors_;
  std::vector<size_t> by_size_;  // tensor indices, largest first
  std::vector<CopyPiece> copy_pieces_;
  size_t arena_bytes_ = 0;
  AlignedBuffer old_, new_;
  AlignedBuffer work_;  // memcpy target, diff snapshot and decode target in turn
  uint64_t trainer_changed_ = 0;
  DiffKernel kernel_ = DiffKernel::kScalar;
  std::vector<ChangeSet> changes_;          // reference diff of old -> new
  std::vector<ChangeSet> scratch_changes_;  // written by the timed diffs
  BenchResult result_;
};

}  // namespace

const BenchEncodingResult* BenchResult::Find(Encoding encoding) const {
  for (const BenchEncodingResult& e : encodings) {
    if (e.encoding == encoding) return &e;
  }
  return nullptr;
}

Result<BenchResult> RunBench(const BenchConfig& config, const BenchProgress& progress) {
  BenchRun run(config, progress);
  return run.Run();
}

std::string CpuModelName() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string model = line.substr(colon + 1);
    model.erase(0, model.find_first_not_of(" \t"));
    model.erase(model.find_last_not_of(" \t") + 1);
    if (!model.empty()) return model;
  }
  return "unknown";
}

}  // namespace deltasync::cli
