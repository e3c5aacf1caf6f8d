// FP32 reductions into rows of a global accumulator, the way the backward kernels add their dK / dKV rows: the rate
// of `red.global.add.v4.f32` against TMA bulk reductions (`cp.reduce.async.bulk.global.shared::cta.add.f32`) from a
// shared-memory staging buffer, with random row ids (GPU, sm_90a).
//
//     nvcc -O3 -arch=sm_90a -o /tmp/l2_reduction bench/l2_reduction.cu && /tmp/l2_reduction [slots] [row_floats] \
//         [energy_seconds] [variants]
//
// Each of `slots` (default 8M: T 4096 x top-k 2048) adds one row of `row_floats` (default 128: the indexer's D; 576
// is the sparse MLA's D_qk) FP32 values of 1.0 into row ids[slot] of an accumulator of `rows` rows (32768 and 131072:
// 16 / 64 MB at 128 floats, in and out of L2), and over 32768 rows in 4096-row windows (rows "32768w"). Variants:
//   seg<L>/<W> red.global.add.v4.f32 with L lanes per row segment (16 bytes each): L = 4 is the kernels' pattern (one
//             warp instruction covers 8 rows x 64 bytes), L = 32 one 512-byte segment of one row; W warps per SM
//             (seg8/8h: on half of the SMs, which tells a per-SM limit from one of the L2);
//   bulk      the CTA writes 32 rows into a shared staging buffer (double-buffered), then one thread issues one bulk
//             reduction per row (a whole row per instruction) and waits for the reads of the buffer before reuse;
//   store     st.global.v4.f32 with 32 lanes per row segment (no reduction: the write path's rate).
// Prints ms and GB/s of reduced bytes (slots x row bytes); checks every accumulator's total against slots x row_floats.
// With energy_seconds > 0, each variant also runs back to back for that long under the GPU's energy counter
// (probe_energy.cuh): J per launch, W, and pJ per reduced byte, total and above the idle board's power (measured
// first), since the sparse MLA backward runs at the power cap, where a byte's energy sets its time. `variants`: a
// comma-separated subset to run (default all).
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <random>
#include <string>
#include <cuda_runtime.h>
#include "probe_energy.cuh"

__device__ __forceinline__ void red_v4(float* p, float v) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" :: "l"(p), "f"(v) : "memory");
}
__device__ __forceinline__ void st_v4(float* p, float v) {
    asm volatile("st.global.v4.f32 [%0], {%1, %1, %1, %1};" :: "l"(p), "f"(v) : "memory");
}

// kLanes lanes per row segment (4: the kernels' quad pattern, 32 / kLanes rows per warp instruction; 32: one
// 512-byte segment of one row per instruction); every slot's row is covered segment by segment.
template <int kLanes, bool kStore>
__global__ void red_seg(float* acc, const int* ids, long slots, int row_floats) {
    constexpr int kRows = 32 / kLanes;
    const int lane = threadIdx.x % 32, q = lane / kLanes, l = lane % kLanes;
    const long warp = (blockIdx.x * (long)blockDim.x + threadIdx.x) / 32;
    const long nwarps = (gridDim.x * (long)blockDim.x) / 32;
    for (long s0 = kRows * warp; s0 < slots; s0 += kRows * nwarps) {
        const long s = s0 + q;
        if (s >= slots) continue;
        float* row = acc + (long)ids[s] * row_floats;
        for (int c = 4 * l; c < row_floats; c += 4 * kLanes) {
            if (kStore) st_v4(row + c, 1.0f); else red_v4(row + c, 1.0f);
        }
    }
}

constexpr int kStageRows = 32;

__global__ void bulk(float* acc, const int* ids, long slots, int row_floats) {
    extern __shared__ __align__(128) float stage[];          // [2][kStageRows][row_floats]
    const int tid = threadIdx.x;
    const long per = (long)kStageRows * gridDim.x;
    int buf = 0;
    for (long s0 = (long)blockIdx.x * kStageRows; s0 < slots; s0 += per, buf ^= 1) {
        float* st = stage + (long)buf * kStageRows * row_floats;
        if (tid == 0)   // the bulk group that read this buffer two batches ago is done reading it
            asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        __syncthreads();
        for (int i = tid; i < kStageRows * row_floats / 4; i += blockDim.x)
            reinterpret_cast<float4*>(st)[i] = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        if (tid == 0) {
            for (int r = 0; r < kStageRows; ++r) {
                if (s0 + r >= slots) break;
                float* dst = acc + (long)ids[s0 + r] * row_floats;
                uint32_t src = (uint32_t)__cvta_generic_to_shared(st + r * row_floats);
                asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                             :: "l"(dst), "r"(src), "r"(row_floats * 4) : "memory");
            }
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
    }
    if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int main(int argc, char** argv) {
    const long slots = argc > 1 ? atol(argv[1]) : 4096L * 2048;
    const int row_floats = argc > 2 ? atoi(argv[2]) : 128;
    const double energy_seconds = argc > 3 ? atof(argv[3]) : 0.0;
    const std::string only = argc > 4 ? "," + std::string(argv[4]) + "," : "";
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("# %s, %d SMs, L2 %d MB; %ld slots of %d floats (%.2f GB reduced)\n", prop.name, sms,
           prop.l2CacheSize >> 20, slots, row_floats, slots * row_floats * 4.0 / 1e9);
    int* d_ids;
    CK(cudaMalloc(&d_ids, slots * sizeof(int)));
    const size_t stage_bytes = 2ull * kStageRows * row_floats * 4;
    CK(cudaFuncSetAttribute(bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)stage_bytes));
    const EnergyProbe energy(energy_seconds);
    printf("%9s %-9s %9s %9s %s%s\n", "rows", "variant", "ms", "GB/s", "check", energy.columns());
    for (int mode = 0; mode < 3; ++mode) {
        // 0, 1: ids uniform over 32768 / 131072 rows; 2: over 32768 rows, but slot s in the 4096-row window
        // s * 8 / slots (the sparse MLA backward's window ordering: every CTA adds into the same window at once)
        const long rows = mode == 1 ? 131072L : 32768L;
        std::vector<int> ids(slots);
        std::mt19937 gen(1234 + mode);
        std::uniform_int_distribution<int> pick(0, mode == 2 ? 4095 : (int)rows - 1);
        for (long i = 0; i < slots; ++i) ids[i] = pick(gen) + (mode == 2 ? (int)(i * 8 / slots) * 4096 : 0);
        CK(cudaMemcpy(d_ids, ids.data(), slots * sizeof(int), cudaMemcpyHostToDevice));
        float* d_acc;
        CK(cudaMalloc(&d_acc, rows * row_floats * sizeof(float)));
        for (const char* name : {"seg4/32", "seg8/32", "seg16/32", "seg32/32", "seg4/8", "seg8/8", "seg16/8",
                                 "seg32/8", "seg8/8h", "bulk", "store"}) {
            const std::string v(name);
            if (!only.empty() && only.find("," + v + ",") == std::string::npos) continue;
            auto launch = [&]() {
                if (v == "seg4/32") red_seg<4, false><<<sms * 4, 256>>>(d_acc, d_ids, slots, row_floats);
                else if (v == "seg8/32") red_seg<8, false><<<sms * 4, 256>>>(d_acc, d_ids, slots, row_floats);
                else if (v == "seg16/32") red_seg<16, false><<<sms * 4, 256>>>(d_acc, d_ids, slots, row_floats);
                else if (v == "seg32/32") red_seg<32, false><<<sms * 4, 256>>>(d_acc, d_ids, slots, row_floats);
                else if (v == "seg4/8") red_seg<4, false><<<sms, 256>>>(d_acc, d_ids, slots, row_floats);
                else if (v == "seg8/8") red_seg<8, false><<<sms, 256>>>(d_acc, d_ids, slots, row_floats);
                else if (v == "seg16/8") red_seg<16, false><<<sms, 256>>>(d_acc, d_ids, slots, row_floats);
                else if (v == "seg8/8h") red_seg<8, false><<<sms / 2, 256>>>(d_acc, d_ids, slots, row_floats);
                else if (v == "seg32/8") red_seg<32, false><<<sms, 256>>>(d_acc, d_ids, slots, row_floats);
                else if (v == "bulk") bulk<<<sms * 2, 128, stage_bytes>>>(d_acc, d_ids, slots, row_floats);
                else red_seg<32, true><<<sms * 4, 256>>>(d_acc, d_ids, slots, row_floats);
            };
            CK(cudaMemset(d_acc, 0, rows * row_floats * sizeof(float)));
            launch();                                         // the check run
            CK(cudaDeviceSynchronize());
            std::vector<float> h(rows * row_floats);
            CK(cudaMemcpy(h.data(), d_acc, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
            double total = 0;
            for (float x : h) total += x;
            const double want = v == "store" ? -1.0 : (double)slots * row_floats;
            const bool ok = v == "store" || total == want;
            const float best = best_ms(launch);
            const double bytes = slots * row_floats * 4.0;
            printf("%8ld%s %-9s %9.3f %9.1f %s", rows, mode == 2 ? "w" : " ", name, best, bytes / best / 1e6,
                   ok ? "ok   " : "WRONG");
            energy.print(launch, bytes);
            printf("\n");
        }
        CK(cudaFree(d_acc));
    }
    return 0;
}
