#include <CLI/CLI.hpp>
#include <exception>
#include <string>

#include "cli_util.h"

namespace deltasync::cli {

int Main(int argc, char** argv) {
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

}  // namespace deltasync::cli
