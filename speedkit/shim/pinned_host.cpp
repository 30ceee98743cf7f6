// Pinned host memory for parked saved tensors (saved_offload.cpp), in a pool of large registered
// chunks. PyTorch's pinned allocator calls cudaHostAlloc for each block (rounded up to a power of
// two), and the driver pins that page by page: 2.7 s for 4.1 GiB in 82 blocks on an H200 host, and
// 0.5 s more to give them back. Here a chunk is mapped (in 2 MiB pages where the kernel's transparent
// huge pages allow it), faulted in by several threads and registered whole with the driver: 0.3 s
// for the same 4.1 GiB on that host. Blocks are carved from the chunks at their own size; the next
// warm-up step parks the same storages again in the same blocks.
#include "pinned_host.h"

#include "kernels.h"

#include <ATen/Functions.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <vector>

namespace sk::pinned_host {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;
// Each registration costs a driver call; a step parks a few GiB.
constexpr size_t kSmallestChunk = size_t{256} << 20;
constexpr size_t kBlockAlignment = 512;
constexpr size_t kTouchedPerThread = size_t{64} << 20;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Writes `bytes` at `start` on up to eight threads, so that the kernel faults the pages in
// parallel (the driver would fault them one by one as it registers them).
void fault_in(char* start, size_t bytes) {
  const size_t most = std::min<size_t>(8, std::max(1u, std::thread::hardware_concurrency()));
  const size_t threads = std::clamp<size_t>(bytes / kTouchedPerThread, 1, most);
  const size_t slice = round_up((bytes + threads - 1) / threads, kHugePage);
  auto touch = [=](size_t at) { std::memset(start + at, 0, std::min(slice, bytes - at)); };
  std::vector<std::thread> touching;
  for (size_t at = slice; at < bytes; at += slice) {
    try {
      touching.emplace_back(touch, at);
    } catch (const std::system_error&) {
      touch(at);  // no thread to spare: this one does it
    }
  }
  touch(0);
  for (auto& thread : touching) thread.join();
}

// Anonymous memory of `bytes` (a multiple of kHugePage) at a kHugePage-aligned address, faulted in.
char* map_faulted_in(size_t bytes) {
  const size_t span = bytes + kHugePage;
  void* mapped = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) throw std::system_error(errno, std::generic_category(), "mmap of host memory to pin");
  char* begin = static_cast<char*>(mapped);
  char* start = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(begin), kHugePage));
  if (start != begin) munmap(begin, start - begin);
  if (start + bytes != begin + span) munmap(start + bytes, begin + span - (start + bytes));
  madvise(start, bytes, MADV_HUGEPAGE);  // a hint: where the kernel declines, 4 KiB pages
  fault_in(start, bytes);
  return start;
}

// One registered mapping and its free ranges (offset to length).
class Chunk {
 public:
  Chunk(size_t bytes, int device) : bytes_(bytes), data_(map_faulted_in(bytes)) {
    try {
      kernels::driver::register_host_memory(data_, bytes_, device);
    } catch (...) {
      munmap(data_, bytes_);
      throw;
    }
    free_[0] = bytes_;
  }
  ~Chunk() {
    try {
      kernels::driver::unregister_host_memory(data_);
    } catch (...) {
      // The mapping goes all the same; the driver forgets its pages with it.
    }
    munmap(data_, bytes_);
  }
  Chunk(const Chunk&) = delete;
  Chunk& operator=(const Chunk&) = delete;

  char* data() const { return data_; }

  // The offset of `bytes` taken from the first free range that holds them.
  std::optional<size_t> take(size_t bytes) {
    for (auto range = free_.begin(); range != free_.end(); ++range) {
      if (range->second < bytes) continue;
      const auto [offset, length] = *range;
      free_.erase(range);
      if (length > bytes) free_[offset + bytes] = length - bytes;
      return offset;
    }
    return std::nullopt;
  }

  // Frees `bytes` at `offset`, merged with the free ranges it touches.
  void give_back(size_t offset, size_t bytes) {
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && offset + bytes == next->first) {
      bytes += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto previous = std::prev(next);
      if (previous->first + previous->second == offset) {
        previous->second += bytes;
        return;
      }
    }
    free_[offset] = bytes;
  }

 private:
  const size_t bytes_;
  char* const data_;
  std::map<size_t, size_t> free_;
};

// The chunks, shared by the tensors lent from them.
class Pool : public std::enable_shared_from_this<Pool> {
 public:
  ~Pool() {
    // A copy may still read or write a block: the memory is unpinned after it.
    try {
      if (copies_pending_on_) synchronize(*copies_pending_on_);
    } catch (...) {
      // A device that cannot synchronize runs no copy either.
    }
  }

  at::Tensor take(int64_t bytes, c10::Device device) {
    const size_t size = round_up(static_cast<size_t>(bytes), kBlockAlignment);
    std::lock_guard<std::mutex> lock(mutex_);
    // A block given back may still be read by its last copy (enqueued on any stream): wait for
    // those before lending one again. Blocks are given back in the backward, so a step waits once
    // or twice.
    if (copies_pending_on_) {
      synchronize(*copies_pending_on_);
      copies_pending_on_.reset();
    }
    for (const auto& chunk : chunks_) {
      if (auto offset = chunk->take(size)) return lend(*chunk, *offset, bytes, size, device);
    }
    const size_t chunk_bytes = round_up(std::max({size, kSmallestChunk, registered_ / 4}), kHugePage);
    chunks_.push_back(std::make_unique<Chunk>(chunk_bytes, device.index()));
    registered_ += chunk_bytes;
    return lend(*chunks_.back(), *chunks_.back()->take(size), bytes, size, device);
  }

 private:
  static void synchronize(c10::Device device) {
    c10::impl::getDeviceGuardImpl(c10::kCUDA)->synchronizeDevice(device.index());
  }

  at::Tensor lend(Chunk& chunk, size_t offset, int64_t bytes, size_t size, c10::Device device) {
    auto give_back = [pool = shared_from_this(), chunk = &chunk, offset, size, device](void*) {
      std::lock_guard<std::mutex> lock(pool->mutex_);
      chunk->give_back(offset, size);
      pool->copies_pending_on_ = device;
    };
    return at::from_blob(chunk.data() + offset, {bytes}, give_back, at::TensorOptions().dtype(at::kByte));
  }

  std::mutex mutex_;
  std::vector<std::unique_ptr<Chunk>> chunks_;
  size_t registered_ = 0;
  // The device whose copies may still use a block given back since the last wait.
  std::optional<c10::Device> copies_pending_on_;
};

std::mutex pool_mutex;
std::shared_ptr<Pool> pool;  // under pool_mutex

}  // namespace

at::Tensor take(int64_t bytes, c10::Device device) {
  std::shared_ptr<Pool> lender;
  {
    std::lock_guard<std::mutex> lock(pool_mutex);
    if (!pool) pool = std::make_shared<Pool>();
    lender = pool;
  }
  return lender->take(bytes, device);
}

void release() {
  std::shared_ptr<Pool> released;
  {
    std::lock_guard<std::mutex> lock(pool_mutex);
    released.swap(pool);
  }
}

}  // namespace sk::pinned_host
