// Host shim: compile a CUDA kernel source with g++ -std=c++20 and run it on the CPU, unchanged.
//
// Include this BEFORE the .cu file. It supplies what nvcc would:
//   * __half / __nv_bfloat16 from the CUDA toolkit's own cuda_fp16.h / cuda_bf16.h (they have host-side
//     conversions; compile with -I<toolkit>/include), so rounding is bit-identical to the device's;
//   * threadIdx/blockIdx/blockDim/gridDim;
//   * __syncthreads() as a barrier over the block's threads;
//   * __shfl_xor_sync/__shfl_down_sync/__shfl_sync as a warp-wide rendezvous: each lane publishes its value in
//     a per-warp exchange array, waits on the warp's barrier, reads its partner's slot, then waits again so no
//     lane overwrites a slot before everyone has read it. Like a converged warp, all lanes of the warp must
//     call it (a kernel that shuffles or syncs under divergence deadlocks here, which the shim detects and
//     reports, instead of silently passing);
//   * __shared__ -> `static`. Blocks run strictly one after another, so a function-local static array is shared
//     by exactly the threads of the one running block, which is what __shared__ means. (thread_local would give
//     each thread its own copy, which is wrong.) Shared memory is NOT cleared between blocks, as on the device.
//   * launch(kernel, grid, block, args...): runs the grid block by block.
//
// Execution model: each CUDA thread of the running block is a fiber (ucontext, own stack) on the calling OS
// thread; a fiber runs until it waits on a barrier (__syncthreads, a shuffle) or returns, then the scheduler
// resumes the others. Between two barriers the threads therefore run one after another, in an order that is
// reshuffled (seeded PRNG) at every scheduling round, so a missing __syncthreads shows up as wrong results for
// some order. (The first version used one std::thread per CUDA thread: same semantics, but each barrier cost
// futex wake-ups of 64+ OS threads on 2 cores, ~100x slower, which priced the test matrix out of CI.)
//
// Only what the kernels in this folder use is emulated: 1-D thread blocks, 3-D grids, no dynamic shared
// memory, no atomics, no cooperative groups.
#pragma once

#define PAGED_HOST_SHIM 1

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <setjmp.h>
#include <ucontext.h>
#include <vector>

#undef __shared__
#define __shared__ static
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__
#ifndef __forceinline__
#define __forceinline__ inline
#endif
#define __launch_bounds__(...)

inline dim3 threadIdx;  // set by the scheduler each time it resumes a fiber
inline dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

namespace shim {

struct Barrier {
    int expected = 0, arrived = 0;
    unsigned long long phase = 0;
};

struct Fiber {
    ucontext_t ctx;  // only to enter the fiber the first time
    jmp_buf jb;      // where it yielded
    std::vector<char> stack;
    unsigned tid = 0;
    bool started = false;
    bool done = false;
    const Barrier* wait_on = nullptr;  // blocked until wait_on->phase != wait_phase
    unsigned long long wait_phase = 0;
};

struct Warp {
    Barrier bar;
    alignas(16) unsigned char slot[32][16];
};

struct Sched {
    jmp_buf main;
    std::vector<Fiber> fibers;
    Fiber* cur = nullptr;
    Barrier block_bar;
    std::vector<Warp> warps;
    std::mt19937 rng{12345};
    void (*body)() = nullptr;  // runs the kernel with the launch's arguments
    unsigned long long arrivals = 0;  // barrier arrivals so far: no arrival and no exit in a round = deadlock
};

inline Sched* sched = nullptr;

// Context switches: makecontext/setcontext to enter a fiber once, then _setjmp/_longjmp (no signal-mask system
// call, unlike swapcontext) for every yield and resume.
inline void yield() {
    if (_setjmp(sched->cur->jb) == 0) _longjmp(sched->main, 1);
}

inline void wait(Barrier& b) {
    const unsigned long long ph = b.phase;
    ++sched->arrivals;
    if (++b.arrived == b.expected) {
        b.arrived = 0;
        ++b.phase;
        return;
    }
    sched->cur->wait_on = &b;
    sched->cur->wait_phase = ph;
    while (b.phase == ph) yield();  // the scheduler only resumes us once the phase moved
    sched->cur->wait_on = nullptr;
}

inline int lane() { return (int)(threadIdx.x % 32); }

template <class T>
T exchange(T v, int src) {
    static_assert(sizeof(T) <= 16, "shuffle of a type wider than 16 bytes");
    Warp& w = sched->warps[threadIdx.x / 32];
    std::memcpy(w.slot[lane()], &v, sizeof(T));
    wait(w.bar);
    T r;
    std::memcpy(&r, w.slot[src], sizeof(T));
    wait(w.bar);
    return r;
}

// Source lane within the lane's `width`-segment, or the lane itself when out of the segment (CUDA semantics).
inline int in_segment(int src, int width) {
    int base = lane() & ~(width - 1);
    return (src >= base && src < base + width) ? src : lane();
}

}  // namespace shim

inline void __syncthreads() { shim::wait(shim::sched->block_bar); }

template <class T>
T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
    return shim::exchange(v, shim::in_segment(shim::lane() ^ lane_mask, width));
}
template <class T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    return shim::exchange(v, shim::in_segment(shim::lane() + (int)delta, width));
}
template <class T>
T __shfl_sync(unsigned, T v, int src_lane, int width = 32) {
    int base = shim::lane() & ~(width - 1);
    return shim::exchange(v, base + (src_lane & (width - 1)));
}

template <class T>
inline T __ldg(const T* p) { return *p; }

// CUDA's integer min/max built-ins (device code calls them unqualified).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

namespace shim {

inline void trampoline() {
    sched->body();
    sched->cur->done = true;
    _longjmp(sched->main, 1);  // never returns through uc_link
}

inline void resume(Fiber& f) {
    if (_setjmp(sched->main) == 0) {
        if (!f.started) {
            f.started = true;
            setcontext(&f.ctx);
        }
        _longjmp(f.jb, 1);
    }
}

// Run kernel over the grid, one block at a time, each block as blockDim.x fibers (see the header comment).
template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, A&&... args) {
    if (block.y != 1 || block.z != 1) throw std::invalid_argument("host shim: 1-D thread blocks only");
    if (block.x == 0 || block.x > 1024) throw std::invalid_argument("host shim: bad block size");
    gridDim = grid;
    blockDim = block;
    const int n = (int)block.x;
    constexpr std::size_t STACK = 256 * 1024;

    Sched s;
    s.fibers.resize(n);
    for (auto& f : s.fibers) f.stack.resize(STACK);
    s.warps.resize((n + 31) / 32);
    // The body is a capture-less function: the kernel and its arguments are reached through this static.
    static thread_local std::function<void()>* call = nullptr;
    std::function<void()> fn = [&] { kernel(args...); };
    call = &fn;
    s.body = [] { (*call)(); };
    Sched* saved = sched;
    sched = &s;

    std::vector<int> order(n);
    for (int i = 0; i < n; ++i) order[i] = i;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = dim3(x, y, z);
                s.block_bar = Barrier{n, 0, 0};
                for (int w = 0; w < (int)s.warps.size(); ++w) s.warps[w].bar = Barrier{std::min(32, n - 32 * w), 0, 0};
                for (int t = 0; t < n; ++t) {
                    Fiber& f = s.fibers[t];
                    f.tid = (unsigned)t;
                    f.done = f.started = false;
                    f.wait_on = nullptr;
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = f.stack.data();
                    f.ctx.uc_stack.ss_size = f.stack.size();
                    f.ctx.uc_link = nullptr;
                    makecontext(&f.ctx, trampoline, 0);
                }
                int live = n;
                while (live > 0) {
                    std::shuffle(order.begin(), order.end(), s.rng);
                    const unsigned long long arrivals = s.arrivals;
                    int done_now = 0;
                    for (int t : order) {
                        Fiber& f = s.fibers[t];
                        if (f.done || (f.wait_on && f.wait_on->phase == f.wait_phase)) continue;
                        s.cur = &f;
                        threadIdx = dim3(f.tid, 0, 0);
                        resume(f);
                        if (f.done) ++done_now;
                    }
                    live -= done_now;
                    if (live > 0 && done_now == 0 && s.arrivals == arrivals) {
                        sched = saved;
                        throw std::runtime_error("host shim: deadlock (barrier or shuffle under divergence)");
                    }
                }
            }
    sched = saved;
}

}  // namespace shim
