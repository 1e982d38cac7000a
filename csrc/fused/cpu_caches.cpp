// The per-core data cache sizes that the tiled kernels size their blocks by (cpu_kernels.h),
// read once per process: from /sys/devices/system/cpu/cpu0/cache/index*/ (level, type,
// size), else from sysconf, else the smallest common sizes (32 KiB L1d, 256 KiB L2).
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <string>

#include "cpu_kernels.h"

namespace megatron_fused {
namespace cpu {

namespace {

// "48K", "1024K", "2M" or a plain byte count -> bytes; 0 where unreadable.
int64_t parse_size(const std::string& text) {
  long long value = 0;
  char unit = 0;
  const int got = std::sscanf(text.c_str(), "%lld%c", &value, &unit);
  if (got < 1 || value <= 0) return 0;
  if (got == 2 && (unit == 'K' || unit == 'k')) return value << 10;
  if (got == 2 && (unit == 'M' || unit == 'm')) return value << 20;
  return value;
}

std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// (L1 data, L2) of cpu0 from sysfs; 0 for a level it does not list.
CpuCaches sysfs_caches() {
  CpuCaches found{0, 0};
  for (int index = 0; index < 16; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    const std::string level = read_line(dir + "/level"), type = read_line(dir + "/type");
    if (level.empty()) continue;
    const int64_t size = parse_size(read_line(dir + "/size"));
    if (level == "1" && type == "Data") found.l1d = size;
    if (level == "2" && type != "Instruction") found.l2 = size;
  }
  return found;
}

CpuCaches detected_caches() {
  CpuCaches caches = sysfs_caches();
#ifdef _SC_LEVEL1_DCACHE_SIZE
  if (caches.l1d <= 0) caches.l1d = sysconf(_SC_LEVEL1_DCACHE_SIZE);
  if (caches.l2 <= 0) caches.l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
  if (caches.l1d <= 0) caches.l1d = 32 << 10;
  if (caches.l2 <= 0) caches.l2 = 256 << 10;
  return caches;
}

const CpuCaches kDetected = detected_caches();  // at load time
std::atomic<int64_t> l1d_override{0}, l2_override{0};

}  // namespace

CpuCaches cpu_caches() {
  const int64_t l1d = l1d_override.load(), l2 = l2_override.load();
  return {l1d > 0 ? l1d : kDetected.l1d, l2 > 0 ? l2 : kDetected.l2};
}

void set_cpu_caches(int64_t l1d, int64_t l2) {
  l1d_override.store(l1d);
  l2_override.store(l2);
}

}  // namespace cpu
}  // namespace megatron_fused
