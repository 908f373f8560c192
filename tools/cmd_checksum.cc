// deltasync checksum --algo A FILE...   ("<hex>  <file>" lines, like sha256sum)
#include <iostream>

#include "cli_util.h"
#include "deltasync/checksum.h"

namespace deltasync::cli {

void RegisterChecksum(CLI::App& app, CommandFn* run) {
  struct Opts {
    std::string algo = "xxh3-128";
    std::vector<std::string> files;
  };
  auto opts = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "checksum", "Print a checksum of each file as \"<hex>  <file>\" lines, as sha256sum does");
  cmd->add_option("--algo,-a", opts->algo, "xxh3-128 (default) | xxh3-64 | blake3 | adler32");
  cmd->add_option("files", opts->files, "Files to hash")->required();
  cmd->callback([opts, run] {
    *run = [opts]() -> int {
      Result<ChecksumAlgo> algo = ParseChecksumAlgo(opts->algo);
      if (!algo.ok()) return Fail(algo.status());
      int rc = 0;
      for (const std::string& file : opts->files) {
        Result<std::string> hex = ChecksumFileHex(*algo, file);
        if (!hex.ok()) {
          rc = Fail(hex.status());  // keep going, like sha256sum
          continue;
        }
        std::cout << *hex << "  " << file << "\n";
      }
      std::cout.flush();
      return rc;
    };
  });
}

}  // namespace deltasync::cli
