// Status and Result<T>: the error model of every data-path function.
//
// Data-path code never throws. A function that can fail returns Status (no
// value) or Result<T> (a value or the Status that explains its absence).
// Exceptions are allowed only at the edges: the CLI, the HTTP agent and the
// Python bindings, which convert a Status into their own error form.
#pragma once

#include <cassert>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace deltasync {

// Stable numeric codes: they appear in CLI exit codes, JSON and logs, so a
// value is never reused or renumbered.
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,     // the caller passed something unusable
  kNotFound = 2,            // a named file, tensor or version does not exist
  kCorruption = 3,          // stored bytes violate their format or checksum
  kIOError = 4,             // the operating system refused an operation
  kOutOfRange = 5,          // an index, offset or size past a limit
  kUnsupported = 6,         // well-formed but not handled (unknown dtype, ...)
  kAlreadyExists = 7,       // refusing to overwrite
  kFailedPrecondition = 8,  // the system is not in a state that allows it
  kAborted = 9,             // cancelled or interrupted
  kInternal = 10,           // a broken invariant: a bug, never bad input
  kDeadlineExceeded = 11,   // a peer did not answer within the operation's timeout
  kUnavailable = 12,        // a peer or service cannot be reached (connection lost)
};

// The name of a code, e.g. "Corruption". Never empty.
std::string_view StatusCodeName(StatusCode code);

// A value type: cheap to copy when OK (no allocation), carries a code and a
// message otherwise.
class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string msg) {
    return {StatusCode::kInvalidArgument, std::move(msg)};
  }
  static Status NotFound(std::string msg) { return {StatusCode::kNotFound, std::move(msg)}; }
  static Status Corruption(std::string msg) { return {StatusCode::kCorruption, std::move(msg)}; }
  static Status IOError(std::string msg) { return {StatusCode::kIOError, std::move(msg)}; }
  static Status OutOfRange(std::string msg) { return {StatusCode::kOutOfRange, std::move(msg)}; }
  static Status Unsupported(std::string msg) { return {StatusCode::kUnsupported, std::move(msg)}; }
  static Status AlreadyExists(std::string msg) {
    return {StatusCode::kAlreadyExists, std::move(msg)};
  }
  static Status FailedPrecondition(std::string msg) {
    return {StatusCode::kFailedPrecondition, std::move(msg)};
  }
  static Status Aborted(std::string msg) { return {StatusCode::kAborted, std::move(msg)}; }
  static Status Internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }
  static Status DeadlineExceeded(std::string msg) {
    return {StatusCode::kDeadlineExceeded, std::move(msg)};
  }
  static Status Unavailable(std::string msg) { return {StatusCode::kUnavailable, std::move(msg)}; }
  // IOError from errno, formatted "<context>: <strerror(errnum)>".
  static Status FromErrno(int errnum, std::string_view context);

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "OK" or "<CodeName>: <message>".
  std::string ToString() const;

  // Returns a copy whose message is "<prefix>: <message>"; OK stays OK.
  Status WithContext(std::string_view prefix) const;

  bool IsNotFound() const { return code_ == StatusCode::kNotFound; }
  bool IsCorruption() const { return code_ == StatusCode::kCorruption; }
  bool IsInvalidArgument() const { return code_ == StatusCode::kInvalidArgument; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Either a T or a non-OK Status. Accessing the value of an error Result is a
// programming error (asserted in debug builds).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!std::get<Status>(v_).ok() && "Result constructed from an OK Status");
    if (std::get<Status>(v_).ok()) v_ = Status::Internal("Result constructed from an OK Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  // OK when holding a value.
  Status status() const { return ok() ? Status::OK() : std::get<Status>(v_); }

  T& value() & {
    assert(ok());
    return std::get<T>(v_);
  }
  const T& value() const& {
    assert(ok());
    return std::get<T>(v_);
  }
  T&& value() && {
    assert(ok());
    return std::get<T>(std::move(v_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace deltasync

#define DS_CONCAT_INNER_(a, b) a##b
#define DS_CONCAT_(a, b) DS_CONCAT_INNER_(a, b)

// Returns the Status of `expr` from the enclosing function if it is not OK.
#define DS_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::deltasync::Status ds_status_ = (expr); \
    if (!ds_status_.ok()) return ds_status_; \
  } while (0)

// `DS_ASSIGN_OR_RETURN(auto x, F());` declares x from F()'s value, or returns
// F()'s Status from the enclosing function.
#define DS_ASSIGN_OR_RETURN(lhs, expr) \
  DS_ASSIGN_OR_RETURN_IMPL_(DS_CONCAT_(ds_result_, __LINE__), lhs, expr)
#define DS_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
