#include "deltasync/status.h"

#include <cstring>

namespace deltasync {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kCorruption: return "Corruption";
    case StatusCode::kIOError: return "IOError";
    case StatusCode::kOutOfRange: return "OutOfRange";
    case StatusCode::kUnsupported: return "Unsupported";
    case StatusCode::kAlreadyExists: return "AlreadyExists";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kAborted: return "Aborted";
    case StatusCode::kInternal: return "Internal";
    case StatusCode::kDeadlineExceeded: return "DeadlineExceeded";
    case StatusCode::kUnavailable: return "Unavailable";
  }
  return "Unknown";
}

Status Status::FromErrno(int errnum, std::string_view context) {
  char buf[256];
  // GNU strerror_r returns the message pointer, which may not be buf.
  const char* msg = strerror_r(errnum, buf, sizeof(buf));
  std::string text(context);
  text += ": ";
  text += msg;
  return IOError(std::move(text));
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(code_));
  out += ": ";
  out += message_;
  return out;
}

Status Status::WithContext(std::string_view prefix) const {
  if (ok()) return *this;
  std::string msg(prefix);
  msg += ": ";
  msg += message_;
  return Status(code_, std::move(msg));
}

}  // namespace deltasync
