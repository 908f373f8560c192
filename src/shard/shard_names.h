// How the shard module's messages name tensors and specs.
#pragma once

#include <string>
#include <string_view>

#include "deltasync/shard.h"

namespace deltasync::shard_names {

// 'name', quoted. Built by appending: GCC 12 warns (-Wrestrict, falsely)
// on "'" + string.
inline std::string Quote(std::string_view name) {
  std::string s(1, '\'');
  s.append(name);
  s += '\'';
  return s;
}

// A spec by its first piece's HF tensor, quoted.
inline std::string SpecName(const ShardSpec& spec) {
  return spec.pieces.empty() ? std::string("(no pieces)") : Quote(spec.pieces[0].hf_name);
}

}  // namespace deltasync::shard_names
