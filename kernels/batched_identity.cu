// Batched identity copy for pipemark's custom-call targets (`pipeline_marker`, `identity`).
//
// One launch copies up to PIPEMARK_MAX_PAIRS buffers. The table of (source, destination,
// byte count) travels by value as the kernel's only parameter, so a launch needs no device
// allocation and no host-to-device copy, and replays unchanged from a captured CUDA graph.
//
// Grid: blockIdx.y picks the pair, blockIdx.x and threadIdx.x stride over its bytes.
// Each pair is copied in words of the widest width W in {16, 8, 4, 2, 1} for which source
// and destination are equally misaligned; bytes before the first W-aligned address (head)
// and after the last whole word (tail) are copied one at a time. A pair whose destination
// is its source (XLA aliased the buffers) or whose size is 0 is skipped. Source and
// destination ranges must not partially overlap; pipemark checks that before launching.
//
// The per-thread work is a __host__ __device__ function so that tests compile this file
// for the host and run exactly this code on CPU memory (see tests/test_kernels.py).

#ifndef PIPEMARK_MAX_PAIRS
#define PIPEMARK_MAX_PAIRS 128
#endif

#if defined(__CUDACC_RTC__)
typedef unsigned long long pipemark_uintptr;
#else
#include <stdint.h>
typedef uintptr_t pipemark_uintptr;
#endif

struct pipemark_copy_pair {
  const unsigned char* src;
  unsigned char* dst;
  unsigned long long size;  // bytes
};

struct pipemark_copy_table {
  pipemark_copy_pair pairs[PIPEMARK_MAX_PAIRS];
  unsigned int count;  // pairs in use; gridDim.y == count
  unsigned int unused;
};

// Kernel parameters are limited to 4 KiB on every architecture pipemark targets.
static_assert(sizeof(pipemark_copy_pair) == 24, "pair layout must match pipemark/custom_call.py");
static_assert(sizeof(pipemark_copy_table) == 24 * PIPEMARK_MAX_PAIRS + 8,
              "table layout must match pipemark/custom_call.py");
static_assert(sizeof(pipemark_copy_table) <= 4096, "the table must fit in kernel parameters");

// Bytes before the first address where both pointers are `width`-aligned, capped at size.
__host__ __device__ inline unsigned long long pipemark_head_bytes(pipemark_uintptr src,
                                                                  unsigned long long size,
                                                                  unsigned long long width) {
  unsigned long long head = (width - (src & (width - 1))) & (width - 1);
  return head < size ? head : size;
}

// The widest word both pointers can use together (their misalignments are equal).
__host__ __device__ inline unsigned long long pipemark_word_width(pipemark_uintptr src,
                                                                  pipemark_uintptr dst) {
  pipemark_uintptr diff = src ^ dst;
  if ((diff & 15) == 0) return 16;
  if ((diff & 7) == 0) return 8;
  if ((diff & 3) == 0) return 4;
  if ((diff & 1) == 0) return 2;
  return 1;
}

template <typename Word>
__host__ __device__ inline void pipemark_copy_words(const unsigned char* src, unsigned char* dst,
                                                    unsigned long long words,
                                                    unsigned long long first,
                                                    unsigned long long stride) {
  const Word* s = reinterpret_cast<const Word*>(src);
  Word* d = reinterpret_cast<Word*>(dst);
  for (unsigned long long i = first; i < words; i += stride) d[i] = s[i];
}

// The work of global thread `first` (of `stride` threads) for one pair.
__host__ __device__ inline void pipemark_copy_pair_part(const pipemark_copy_pair& pair,
                                                        unsigned long long first,
                                                        unsigned long long stride) {
  const unsigned char* src = pair.src;
  unsigned char* dst = pair.dst;
  const unsigned long long size = pair.size;
  if (size == 0 || src == dst) return;

  const pipemark_uintptr s = reinterpret_cast<pipemark_uintptr>(src);
  const pipemark_uintptr d = reinterpret_cast<pipemark_uintptr>(dst);
  const unsigned long long width = pipemark_word_width(s, d);
  const unsigned long long head = pipemark_head_bytes(s, size, width);
  const unsigned long long words = (size - head) / width;
  const unsigned long long tail_start = head + words * width;

  for (unsigned long long i = first; i < head; i += stride) dst[i] = src[i];
  switch (width) {
    case 16:
      pipemark_copy_words<uint4>(src + head, dst + head, words, first, stride);
      break;
    case 8:
      pipemark_copy_words<unsigned long long>(src + head, dst + head, words, first, stride);
      break;
    case 4:
      pipemark_copy_words<unsigned int>(src + head, dst + head, words, first, stride);
      break;
    case 2:
      pipemark_copy_words<unsigned short>(src + head, dst + head, words, first, stride);
      break;
    default:
      pipemark_copy_words<unsigned char>(src + head, dst + head, words, first, stride);
  }
  for (unsigned long long i = tail_start + first; i < size; i += stride) dst[i] = src[i];
}

#ifdef __CUDACC__
// uint4 words are single 128-bit loads and stores on the device.
extern "C" __global__ void pipemark_batched_identity(const pipemark_copy_table table) {
  if (blockIdx.y >= table.count) return;
  const unsigned long long first =
      static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  pipemark_copy_pair_part(table.pairs[blockIdx.y], first, stride);
}
#endif
