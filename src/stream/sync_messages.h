// The stream group's messages (docs/format.md, "Stream: commit protocol",
// "Messages"): a 16-byte envelope, then the body as a message of its own.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "deltasync/communicator.h"
#include "deltasync/dtype.h"
#include "deltasync/status.h"
#include "stream/state_digest.h"

namespace deltasync::stream {

inline constexpr size_t kEnvelopeBytes = 16;
// A body other than a frame's is at most this.
inline constexpr uint64_t kMaxControlBodyBytes = uint64_t{1} << 24;
inline constexpr int kStreamProtocol = 1;

enum class MessageType : uint8_t { kHello = 1, kWelcome = 2, kFrame = 3, kReport = 4 };

// "hello", "welcome", "frame", "report".
std::string_view MessageTypeName(MessageType type);

struct Envelope {
  MessageType type = MessageType::kHello;
  bool last = false;  // frames only
  uint64_t body_bytes = 0;
};

std::array<uint8_t, kEnvelopeBytes> EncodeEnvelope(const Envelope& envelope);
// Corruption for a wrong magic, an unknown type, a flag that is not a
// frame's `last`, nonzero zero bytes, or a body past its type's bound.
Result<Envelope> DecodeEnvelope(std::span<const uint8_t, kEnvelopeBytes> bytes);

// Sends an envelope and, when `body` is not empty, the body.
Status SendMessage(Communicator& comm, int peer, MessageType type, bool last,
                   std::span<const uint8_t> body);
// Takes an envelope from `peer` and checks it is of type `expected`
// (InvalidArgument naming both otherwise); the body is still to be taken.
Result<Envelope> RecvEnvelope(Communicator& comm, int peer, MessageType expected);

// A JSON body's message, both ways. RecvJson refuses a body that is not a
// JSON object (Corruption).
Status SendJson(Communicator& comm, int peer, MessageType type, const nlohmann::json& body);
Result<nlohmann::json> RecvJson(Communicator& comm, int peer, MessageType expected);

// One registered tensor of a hello.
struct Registration {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  DigestBlock block;
};

nlohmann::json HelloBody(const std::vector<Registration>& tensors);
// Corruption naming the field for a malformed hello (another protocol:
// Unsupported).
Result<std::vector<Registration>> ParseHello(const nlohmann::json& body);

// A receiver's report (docs/format.md, "Messages").
struct Report {
  Status status;      // OK, or the receiver's error
  bool clean = true;  // no byte of an unverified frame written
};

nlohmann::json ReportBody(const Report& report);
Result<Report> ParseReport(const nlohmann::json& body);

}  // namespace deltasync::stream
