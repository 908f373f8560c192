// deltasync: ship only the weight bytes that changed, bit-exactly.
#include <malloc.h>

#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>

#include "cli_util.h"

int main(int argc, char** argv) {
  using namespace deltasync::cli;
  // Keep memory the process frees for its next allocations instead of
  // handing it back to the kernel at once: a publish or pull frees and
  // reallocates per-tensor buffers, and on the virtual machines we measure
  // on each page handed back costs a fault and a kernel page clear when
  // touched again (a publish of 1 GiB took 4% less time). Peak memory is
  // unchanged: only what was already in use is kept.
  (void)mallopt(M_TRIM_THRESHOLD, 1 << 30);
  (void)mallopt(M_MMAP_THRESHOLD, 32 << 20);
  CLI::App app{
      "deltasync keeps LLM rollout engines' weights in sync with an RL trainer by shipping only "
      "the bytes that changed, bit-exactly.",
      "deltasync"};
  app.set_version_flag("--version", DELTASYNC_VERSION);
  app.require_subcommand(1);

  CommandFn run;
  RegisterInspect(app, &run);
  RegisterChecksum(app, &run);
  RegisterSynth(app, &run);
  RegisterDiff(app, &run);
  RegisterPublish(app, &run);
  RegisterPull(app, &run);
  RegisterVerify(app, &run);
  RegisterVersions(app, &run);
  RegisterPrune(app, &run);
  RegisterBench(app, &run);
  RegisterAgent(app, &run);
  RegisterSync(app, &run);
  RegisterDemo(app, &run);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return run ? run() : 0;
  } catch (const std::exception& e) {
    // Data-path code reports errors as Status; this only catches what the
    // standard library itself throws (e.g. bad_alloc).
    return Fail(std::string("unexpected failure: ") + e.what());
  }
}
