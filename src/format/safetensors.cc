#include "deltasync/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <set>
#include <string_view>
#include <tuple>
#include <utility>

#include "core/endian.h"
#include "format/json_util.h"
#include "io/file.h"

namespace deltasync {
namespace {

using format_internal::QuoteForMessage;
using nlohmann::json;

constexpr size_t kLengthPrefixBytes = 8;
// Top-level object > tensor entry > shape array: anything deeper is invalid
// anyway, and refusing it early bounds the work a hostile header causes.
constexpr int kMaxHeaderDepth = 3;

std::string RangeToString(uint64_t begin, uint64_t end) {
  // Appended piecewise: GCC 12 warns falsely (-Wrestrict) on "[" + to_string.
  std::string out = "[";
  out += std::to_string(begin);
  out += ", ";
  out += std::to_string(end);
  out += ']';
  return out;
}

// A JSON value as a short description for messages: numbers as written,
// everything else by type.
std::string DescribeJson(const json& value) {
  if (value.is_number()) {
    return value.dump(-1, ' ', false, json::error_handler_t::replace);
  }
  return std::string("a JSON ") + value.type_name();
}

// A non-negative integer that fits in 64 bits. nlohmann stores such a
// literal as number_unsigned; negatives become number_integer and anything
// fractional, exponent-form or too large for 64 bits becomes number_float.
Result<uint64_t> NonNegativeInteger(const json& value, const std::string& what) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer()) {
    return Status::Corruption(what + " is negative (" + DescribeJson(value) + ")");
  }
  return Status::Corruption(what + " must be a non-negative integer that fits in 64 bits, found " +
                            DescribeJson(value));
}

Result<SafetensorsEntry> ParseEntry(const std::string& name, const json& value,
                                    uint64_t data_size) {
  const std::string tensor = "tensor " + QuoteForMessage(name);
  if (!value.is_object()) {
    return Status::Corruption(tensor + ": entry must be a JSON object, found " +
                              DescribeJson(value));
  }
  for (const auto& [field, unused] : value.get_ref<const json::object_t&>()) {
    if (field != "dtype" && field != "shape" && field != "data_offsets") {
      return Status::Corruption(tensor + ": unknown field " + QuoteForMessage(field) +
                                " (an entry holds only dtype, shape and data_offsets)");
    }
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(field)) {
      return Status::Corruption(tensor + ": missing field '" + field + "'");
    }
  }

  SafetensorsEntry entry;
  entry.name = name;

  const json& dtype = value["dtype"];
  if (!dtype.is_string()) {
    return Status::Corruption(tensor + ": dtype must be a string, found " + DescribeJson(dtype));
  }
  const std::string& dtype_name = dtype.get_ref<const std::string&>();
  Result<DType> parsed_dtype = ParseDType(dtype_name);
  if (!parsed_dtype.ok()) {
    return Status::Unsupported(tensor + ": unknown dtype " + QuoteForMessage(dtype_name));
  }
  entry.dtype = *parsed_dtype;

  const json& shape = value["shape"];
  if (!shape.is_array()) {
    return Status::Corruption(tensor + ": shape must be an array, found " + DescribeJson(shape));
  }
  uint64_t numel = 1;
  bool numel_overflow = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    const std::string what = tensor + ": shape dimension " + std::to_string(i);
    DS_ASSIGN_OR_RETURN(uint64_t dim, NonNegativeInteger(shape[i], what));
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Status::Corruption(what + " (" + std::to_string(dim) + ") does not fit in int64");
    }
    entry.shape.push_back(static_cast<int64_t>(dim));
    numel_overflow |= __builtin_mul_overflow(numel, dim, &numel);
  }
  uint64_t nbytes = 0;
  if (numel_overflow || __builtin_mul_overflow(numel, DTypeSize(entry.dtype), &nbytes)) {
    return Status::Corruption(tensor + ": shape " + ShapeToString(entry.shape) + " of " +
                              std::string(DTypeName(entry.dtype)) + " exceeds 2^64 bytes");
  }

  const json& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2) {
    return Status::Corruption(tensor + ": data_offsets must be an array [begin, end], found " +
                              (offsets.is_array() ? std::to_string(offsets.size()) + " elements"
                                                  : DescribeJson(offsets)));
  }
  DS_ASSIGN_OR_RETURN(entry.begin, NonNegativeInteger(offsets[0], tensor + ": data_offsets[0]"));
  DS_ASSIGN_OR_RETURN(entry.end, NonNegativeInteger(offsets[1], tensor + ": data_offsets[1]"));
  const std::string range = RangeToString(entry.begin, entry.end);
  if (entry.begin > entry.end) {
    return Status::Corruption(tensor + ": data_offsets " + range + " begin after they end");
  }
  if (entry.end - entry.begin != nbytes) {
    return Status::Corruption(tensor + ": shape " + ShapeToString(entry.shape) + " of " +
                              std::string(DTypeName(entry.dtype)) + " needs " +
                              std::to_string(nbytes) + " bytes but data_offsets " + range +
                              " span " + std::to_string(entry.end - entry.begin));
  }
  if (entry.end > data_size) {
    return Status::Corruption(tensor + ": data_offsets " + range + " extend past the end of the " +
                              std::to_string(data_size) + "-byte data buffer (file truncated?)");
  }
  return entry;
}

Status ParseMetadata(const json& value, std::map<std::string, std::string>* metadata) {
  if (!value.is_object()) {
    return Status::Corruption("__metadata__ must be an object of string -> string, found " +
                              DescribeJson(value));
  }
  for (const auto& [key, item] : value.get_ref<const json::object_t&>()) {
    if (!item.is_string()) {
      return Status::Corruption("__metadata__ value for " + QuoteForMessage(key) +
                                " is not a string (found " + DescribeJson(item) + ")");
    }
    metadata->emplace(key, item.get_ref<const std::string&>());
  }
  return Status::OK();
}

// The reference implementation's rule: sorted by offset, the tensors tile
// the data buffer exactly. Holes would be bytes no checksum or diff covers.
Status CheckTiling(const std::vector<SafetensorsEntry>& entries, uint64_t data_size) {
  uint64_t covered = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const SafetensorsEntry& entry : entries) {
    const std::string tensor = "tensor " + QuoteForMessage(entry.name);
    if (entry.begin < covered) {
      return Status::Corruption(tensor + " at " + RangeToString(entry.begin, entry.end) +
                                " overlaps tensor " + QuoteForMessage(previous->name) + " at " +
                                RangeToString(previous->begin, previous->end));
    }
    if (entry.begin > covered) {
      const std::string gap = std::to_string(entry.begin - covered);
      if (previous == nullptr) {
        return Status::Corruption("hole of " + gap +
                                  " bytes at the start of the data buffer: " + tensor +
                                  " is the first and begins at " + std::to_string(entry.begin));
      }
      return Status::Corruption("hole of " + gap + " bytes between tensor " +
                                QuoteForMessage(previous->name) + " (ends at " +
                                std::to_string(covered) + ") and " + tensor + " (begins at " +
                                std::to_string(entry.begin) + ")");
    }
    covered = entry.end;
    previous = &entry;
  }
  if (covered != data_size) {
    return Status::Corruption("data buffer holds " + std::to_string(data_size) +
                              " bytes but the tensors cover only " + std::to_string(covered) +
                              " (trailing bytes belong to no tensor)");
  }
  return Status::OK();
}

int ToMadvise(AccessHint hint) {
  switch (hint) {
    case AccessHint::kNormal: return MADV_NORMAL;
    case AccessHint::kSequential: return MADV_SEQUENTIAL;
    case AccessHint::kRandom: return MADV_RANDOM;
    case AccessHint::kWillNeed: return MADV_WILLNEED;
    case AccessHint::kDontNeed: return MADV_DONTNEED;
  }
  return MADV_NORMAL;
}

// madvise over whole pages covering [begin, begin + length).
void AdvisePages(const uint8_t* begin, size_t length, int advice) {
  if (length == 0) return;
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t first = reinterpret_cast<uintptr_t>(begin) & ~(page - 1);
  const uintptr_t last = reinterpret_cast<uintptr_t>(begin) + length;
  ::madvise(reinterpret_cast<void*>(first), last - first, advice);
}

}  // namespace

Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const uint8_t> header_json,
                                                 uint64_t data_size) {
  if (header_json.size() > kMaxSafetensorsHeaderBytes) {
    return Status::Corruption("header of " + std::to_string(header_json.size()) +
                              " bytes exceeds the limit of " +
                              std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  const std::string_view text(reinterpret_cast<const char*>(header_json.data()),
                              header_json.size());
  if (text.empty()) return Status::Corruption("header is empty; it must be a JSON object");
  if (const size_t bad = format_internal::FindInvalidUtf8(text); bad != text.npos) {
    return Status::Corruption("header is not valid UTF-8 (bad byte 0x" +
                              [&] {
                                static constexpr char kHex[] = "0123456789abcdef";
                                const auto b = static_cast<uint8_t>(text[bad]);
                                return std::string{kHex[b >> 4], kHex[b & 0xF]};
                              }() +
                              " at header offset " + std::to_string(bad) + ")");
  }
  // The format requires the object to start at the first byte; padding is
  // allowed only at the end.
  if (text[0] != '{') {
    return Status::Corruption("header is not a JSON object: it must begin with '{', found " +
                              QuoteForMessage(text.substr(0, 1)));
  }
  Result<json> parsed = format_internal::ParseJsonStrict(text, kMaxHeaderDepth);
  if (!parsed.ok()) return parsed.status().WithContext("header");
  const json& root = *parsed;
  if (!root.is_object()) {
    return Status::Corruption("header is not a JSON object (found " + DescribeJson(root) + ")");
  }

  SafetensorsHeader header;
  header.entries.reserve(root.size());
  for (const auto& [key, value] : root.get_ref<const json::object_t&>()) {
    if (key == "__metadata__") {
      DS_RETURN_IF_ERROR(ParseMetadata(value, &header.metadata));
      continue;
    }
    DS_ASSIGN_OR_RETURN(SafetensorsEntry entry, ParseEntry(key, value, data_size));
    header.entries.push_back(std::move(entry));
  }
  std::sort(header.entries.begin(), header.entries.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
            });
  DS_RETURN_IF_ERROR(CheckTiling(header.entries, data_size));
  return header;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  uint64_t size = 0;
  DS_ASSIGN_OR_RETURN(const int fd, io::OpenRegularFile(path, &size));
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->size_ = size;
  // Too short to hold the length prefix: Parse reports it without reading,
  // and mmap could not map an empty file anyway.
  if (file->size_ >= kLengthPrefixBytes) {
    void* map = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return Status::FromErrno(err, path + ": mmap");
    }
    file->map_ = map;
    file->image_ = static_cast<const uint8_t*>(map);
  }
  ::close(fd);  // the mapping keeps the file open
  DS_RETURN_IF_ERROR(file->Parse());
  return file;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::OpenMemory(
    std::string name, std::span<const uint8_t> image) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = std::move(name);
  file->image_ = image.data();
  file->size_ = image.size();
  DS_RETURN_IF_ERROR(file->Parse());
  return file;
}

Status SafetensorsFile::Parse() {
  if (size_ < kLengthPrefixBytes) {
    return Status::Corruption(path_ + ": file is " + std::to_string(size_) +
                              " bytes, shorter than the 8-byte header length prefix");
  }
  const uint64_t header_bytes = LoadLe<uint64_t>(image_);
  if (header_bytes > kMaxSafetensorsHeaderBytes) {
    return Status::Corruption(path_ + ": declared header length " + std::to_string(header_bytes) +
                              " exceeds the limit of " +
                              std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  if (header_bytes > size_ - kLengthPrefixBytes) {
    return Status::Corruption(path_ + ": declared header length " + std::to_string(header_bytes) +
                              " extends past the end of the file (" + std::to_string(size_) +
                              " bytes; truncated?)");
  }
  // Every header byte is read right away: one asynchronous read-ahead beats
  // faulting a multi-megabyte header in page by page.
  if (map_ != nullptr) AdvisePages(image_, kLengthPrefixBytes + header_bytes, MADV_WILLNEED);

  header_size_ = header_bytes;
  const uint64_t data_offset = kLengthPrefixBytes + header_bytes;
  data_ = std::span(image_ + data_offset, size_ - data_offset);
  Result<SafetensorsHeader> header =
      ParseSafetensorsHeader(std::span(image_ + kLengthPrefixBytes, header_bytes), data_.size());
  if (!header.ok()) return header.status().WithContext(path_);

  metadata_ = std::move(header->metadata);
  tensors_.reserve(header->entries.size());
  for (SafetensorsEntry& entry : header->entries) {
    index_.emplace(entry.name, tensors_.size());
    tensors_.push_back(TensorView{std::move(entry.name), entry.dtype, std::move(entry.shape),
                                  data_.subspan(entry.begin, entry.end - entry.begin)});
  }
  return Status::OK();
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, size_);
}

Result<TensorView> SafetensorsFile::Get(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return Status::NotFound(path_ + ": no tensor named " + QuoteForMessage(name));
  }
  return tensors_[it->second];
}

void SafetensorsFile::Advise(AccessHint hint, std::span<const uint8_t> bytes) const {
  if (map_ == nullptr) return;
  if (bytes.empty()) bytes = data_;
  // Only ranges inside our own mapping: a stray span must not change the
  // advice on someone else's memory.
  const auto begin = reinterpret_cast<uintptr_t>(bytes.data());
  const auto image = reinterpret_cast<uintptr_t>(image_);
  if (begin < image || begin - image > size_ || bytes.size() > size_ - (begin - image)) return;
  AdvisePages(bytes.data(), bytes.size(), ToMadvise(hint));
}

Result<std::string> BuildSafetensorsHeader(const std::vector<TensorSpec>& specs,
                                           const std::map<std::string, std::string>& metadata) {
  auto require_utf8 = [](std::string_view text, const char* what) -> Status {
    if (format_internal::FindInvalidUtf8(text) != text.npos) {
      return Status::InvalidArgument(std::string(what) + " " + QuoteForMessage(text) +
                                     " is not valid UTF-8");
    }
    return Status::OK();
  };

  std::string json_text = "{";
  if (!metadata.empty()) {
    json_text += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      DS_RETURN_IF_ERROR(require_utf8(key, "metadata key"));
      DS_RETURN_IF_ERROR(require_utf8(value, "metadata value"));
      if (!first) json_text += ',';
      first = false;
      format_internal::AppendJsonString(key, &json_text);
      json_text += ':';
      format_internal::AppendJsonString(value, &json_text);
    }
    json_text += '}';
  }

  std::set<std::string_view> names;
  uint64_t offset = 0;
  for (const TensorSpec& spec : specs) {
    const std::string tensor = "tensor " + QuoteForMessage(spec.name);
    if (spec.name == "__metadata__") {
      return Status::InvalidArgument("'__metadata__' is reserved and cannot name a tensor");
    }
    DS_RETURN_IF_ERROR(require_utf8(spec.name, "tensor name"));
    if (!names.insert(spec.name).second) {
      return Status::InvalidArgument(tensor + " appears more than once");
    }
    uint64_t nbytes = DTypeSize(spec.dtype);
    for (int64_t dim : spec.shape) {
      if (dim < 0) {
        return Status::InvalidArgument(tensor + ": negative dimension in shape " +
                                       ShapeToString(spec.shape));
      }
      if (__builtin_mul_overflow(nbytes, static_cast<uint64_t>(dim), &nbytes)) {
        return Status::InvalidArgument(tensor + ": shape " + ShapeToString(spec.shape) +
                                       " exceeds 2^64 bytes");
      }
    }
    uint64_t end = 0;
    if (__builtin_add_overflow(offset, nbytes, &end)) {
      return Status::InvalidArgument(tensor + ": the data buffer would exceed 2^64 bytes");
    }
    if (json_text.size() > 1) json_text += ',';
    format_internal::AppendJsonString(spec.name, &json_text);
    json_text += ":{\"dtype\":\"";
    json_text += DTypeName(spec.dtype);
    json_text += "\",\"shape\":[";
    for (size_t i = 0; i < spec.shape.size(); ++i) {
      if (i) json_text += ',';
      json_text += std::to_string(spec.shape[i]);
    }
    json_text += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(end) + "]}";
    offset = end;
  }
  json_text += '}';
  while ((kLengthPrefixBytes + json_text.size()) % 8 != 0) json_text += ' ';
  if (json_text.size() > kMaxSafetensorsHeaderBytes) {
    return Status::InvalidArgument("header of " + std::to_string(json_text.size()) +
                                   " bytes would exceed the limit of " +
                                   std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  return json_text;
}

SafetensorsWriter::SafetensorsWriter() = default;
SafetensorsWriter::~SafetensorsWriter() = default;  // AtomicFile removes its temp file

Result<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::vector<TensorSpec> specs,
    const std::map<std::string, std::string>& metadata) {
  Result<std::string> header = BuildSafetensorsHeader(specs, metadata);
  if (!header.ok()) return header.status().WithContext(path);
  uint64_t expected = 0;
  for (const TensorSpec& spec : specs) {
    uint64_t nbytes = DTypeSize(spec.dtype);
    for (int64_t dim : spec.shape) nbytes *= static_cast<uint64_t>(dim);  // checked above
    expected += nbytes;
  }

  std::unique_ptr<SafetensorsWriter> writer(new SafetensorsWriter());
  writer->path_ = path;
  writer->expected_ = expected;
  DS_ASSIGN_OR_RETURN(writer->file_, io::AtomicFile::Create(path));
  uint8_t prefix[kLengthPrefixBytes];
  StoreLe<uint64_t>(prefix, header->size());
  DS_RETURN_IF_ERROR(writer->file_->Write(std::span<const uint8_t>(prefix)));
  DS_RETURN_IF_ERROR(writer->file_->Write(*header));
  return writer;
}

Status SafetensorsWriter::Append(std::span<const uint8_t> bytes) {
  if (finished_) return Status::FailedPrecondition(path_ + ": append after Finish");
  if (bytes.size() > expected_ - written_) {
    return Status::InvalidArgument(path_ + ": appending " + std::to_string(bytes.size()) +
                                   " bytes would pass the " + std::to_string(expected_) +
                                   " bytes the specs declare (" + std::to_string(written_) +
                                   " written)");
  }
  DS_RETURN_IF_ERROR(file_->Write(bytes));
  written_ += bytes.size();
  return Status::OK();
}

Status SafetensorsWriter::Finish() {
  if (finished_) return Status::FailedPrecondition(path_ + ": Finish called twice");
  if (written_ != expected_) {
    return Status::FailedPrecondition(path_ + ": only " + std::to_string(written_) + " of the " +
                                      std::to_string(expected_) +
                                      " declared tensor bytes were appended");
  }
  DS_RETURN_IF_ERROR(file_->Commit());
  finished_ = true;
  return Status::OK();
}

Status WriteSafetensors(const std::string& path, const std::vector<TensorView>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const TensorView& tensor : tensors) {
    if (Status valid = tensor.Validate(); !valid.ok()) {
      return Status::InvalidArgument(path + ": tensor " + QuoteForMessage(tensor.name) + ": " +
                                     valid.message());
    }
    specs.push_back(TensorSpec{tensor.name, tensor.dtype, tensor.shape});
  }
  DS_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> writer,
                      SafetensorsWriter::Create(path, std::move(specs), metadata));
  for (const TensorView& tensor : tensors) DS_RETURN_IF_ERROR(writer->Append(tensor.bytes));
  return writer->Finish();
}

}  // namespace deltasync
