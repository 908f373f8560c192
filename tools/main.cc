// deltasync: ship only the weight bytes that changed, bit-exactly.
#include "cli_util.h"

int main(int argc, char** argv) { return deltasync::cli::Main(argc, argv); }
