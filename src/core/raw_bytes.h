// A byte vector whose resize leaves new bytes uninitialized: for buffers
// that are written whole right after (a snapshot filled by a parallel copy
// would otherwise be zeroed first, a full extra pass over its memory).
#pragma once

#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace deltasync::core_internal {

// std::allocator, except that a value-initialization (resize's, for one)
// default-initializes: trivial types are left as they are.
template <typename T>
class DefaultInitAllocator : public std::allocator<T> {
 public:
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}

  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

using RawBytes = std::vector<uint8_t, DefaultInitAllocator<uint8_t>>;

}  // namespace deltasync::core_internal
