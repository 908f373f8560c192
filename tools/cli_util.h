// Shared plumbing for the deltasync subcommands.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/status.h"
#include "deltasync/store.h"

namespace deltasync::cli {

// A subcommand's body: returns the process exit code. Errors are reported
// through Fail() so that every command prints them the same way.
using CommandFn = std::function<int()>;

// Prints "deltasync: <message>" as one line on stderr and returns the exit
// code for `status` (1 for any error; usage errors exit 2 through CLI11).
int Fail(const Status& status);
int Fail(const std::string& message);

// True when stdout is a terminal (progress output is only shown then).
bool StdoutIsTerminal();

// Human-readable byte counts: "512 B", "1.5 KiB", "3.20 GiB".
std::string FormatBytes(uint64_t bytes);

// Seconds for people to read: three significant digits, and never finer
// than a microsecond nor coarser than a second ("0.0834 s", "2.35 s",
// "184 s", "1234 s"). JSON output keeps the full value instead.
std::string FormatSeconds(double seconds);

// Parses a byte count: "4096", "512MiB", "1GiB", "64KiB", "2GB", "10MB".
// Binary (KiB/MiB/GiB/TiB) and decimal (KB/MB/GB/TB) suffixes; InvalidArgument
// for anything else, for zero-free garbage, or on overflow.
Result<uint64_t> ParseByteSize(const std::string& text);

// Parses a comma-separated list of counts in [1, most] given to `flag`
// ("--receivers"): InvalidArgument naming the flag and the bad item, or an
// empty list.
Result<std::vector<int>> ParseCounts(const std::string& flag, const std::string& text, int most);

// The help text of an --encoding option, generated from the encodings'
// descriptors: "dense | indices | xor | overwrite | sparse (default); the
// Python receiver reads xor and overwrite", with `default_encoding` marked.
std::string EncodingHelp(std::string_view default_encoding);

// The options every command that publishes shares: --store, --old, --new,
// --encoding/-e, --checksum/-c and --full. `receivers` names who holds OLD
// in the help text.
struct PublishFlags {
  std::string store, old_ckpt, new_ckpt, encoding = "sparse", checksum = "xxh3-128";
  bool full = false;
};
void AddPublishFlags(CLI::App* cmd, const std::string& receivers, PublishFlags* flags);
// Fills the store, encoding and checksum of `options` from `flags`;
// InvalidArgument/Unsupported for an unknown encoding or checksum.
Status ApplyPublishFlags(const PublishFlags& flags, PublisherOptions* options);

// Registers a hidden subcommand `name` (for the child processes of a demo
// or benchmark, not for users) whose arguments, unparsed, go to `body`.
void RegisterHiddenCommand(CLI::App& app, const std::string& name,
                           std::function<int(const std::vector<std::string>&)> body,
                           CommandFn* run);

// The whole CLI: registers every subcommand, parses argv, runs the chosen
// one and returns the process exit code. main() of `deltasync`, and of the
// test build that adds fault injection (tools/crash_pause_test_main.cc).
int Main(int argc, char** argv);

// Each subcommand registers itself on the root app and stores its body in
// `run`, which Main() calls after a successful parse.
void RegisterChecksum(CLI::App& app, CommandFn* run);
void RegisterInspect(CLI::App& app, CommandFn* run);
void RegisterSynth(CLI::App& app, CommandFn* run);
void RegisterDiff(CLI::App& app, CommandFn* run);
void RegisterPublish(CLI::App& app, CommandFn* run);
void RegisterPull(CLI::App& app, CommandFn* run);
void RegisterVerify(CLI::App& app, CommandFn* run);
void RegisterVersions(CLI::App& app, CommandFn* run);
void RegisterPrune(CLI::App& app, CommandFn* run);
void RegisterBench(CLI::App& app, CommandFn* run);
void RegisterAgent(CLI::App& app, CommandFn* run);
void RegisterSync(CLI::App& app, CommandFn* run);
void RegisterDemo(CLI::App& app, CommandFn* run);

}  // namespace deltasync::cli
