// FP32 tiles exchanged between the two CTAs of a cluster through distributed shared memory, the way a 2-CTA sparse
// MLA backward would sum the dKV chunks of a row's two head blocks before its atomics: the rate of remote 16-byte
// stores (`st.shared::cluster.v4.f32`, then a release arrive on the partner's mbarrier) and of `st.async` (the
// stores complete the partner's mbarrier themselves), against the FP32 atomics the exchange would replace (GPU,
// sm_90a).
//
//     nvcc -O3 -arch=sm_90a -o /tmp/dsmem_exchange bench/dsmem_exchange.cu && /tmp/dsmem_exchange [chunks] [seconds]
//
// Each CTA of a 2-CTA cluster (one cluster per 2 SMs, 256 threads = the backward's 8 consumer warps) sends
// `chunks` (default 4096) 16 KB FP32 chunks (64 rows x 64 columns) into a 2-slot ring in its partner's shared memory
// and receives as many: per chunk, every thread waits for the partner's slot to be free, stores its 64 bytes there,
// and arrives on the partner's full barrier; the receiver waits for it, adds the slot into its registers and
// frees it. "atomics only" instead adds each chunk into a 32768 x 576 FP32 accumulator with 16-byte atomics (rows in
// 4096-row windows, as the backward orders them), and "st.async + atomics" does both, which tells whether the
// exchange and the atomics share a limit. Prints ms and GB/s of exchanged (both directions) plus reduced bytes and
// checks the received sums and the accumulator's total. With `seconds` > 0 each variant also runs back to back for
// that long under the GPU's energy counter (probe_energy.cuh): J per launch, W, and pJ per moved byte, total and
// above the idle board's power (measured first), since at the power cap a byte's energy sets its time.
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <random>
#include <vector>
#include <cuda_runtime.h>
#include "probe_energy.cuh"

constexpr int kThreads = 256;
constexpr int kChunkFloats = 64 * 64;                       // 16 KB
constexpr int kPerThread = kChunkFloats / kThreads;        // 16 floats = 4 v4 stores

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void arrive_remote(uint32_t remote_bar) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" :: "r"(remote_bar) : "memory");
}

// kAsync false: st.shared::cluster.v4 + a release arrive per thread (full barrier: kThreads arrivals);
// true: st.async with complete_tx on the partner's full barrier, whose own thread 0 expects the bytes.
// kExchange: exchange the chunks; kRed: also add each chunk (16 KB of ones) into the dKV-like accumulator `dkv`
// (rows of kRowFloats FP32, 64-column block c % 9 of the 64 rows ids[64 c ..], 16 lanes per 256-byte row piece:
// two 128-byte segments, as the backward's atomics), so that kExchange + kRed tells whether the two share a limit.
// Every warp does both, one after the other (the exchange's release arrives also order the thread's earlier atomics).
constexpr int kRowFloats = 576;
template <bool kAsync, bool kExchange, bool kRed>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads, 1)
exchange(int chunks, float* out, float* dkv, const int* ids) {
    __shared__ __align__(16) float slot[2][kChunkFloats];
    __shared__ __align__(8) uint64_t full[2], empty[2];
    const int tid = threadIdx.x;
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const uint32_t peer = rank ^ 1;
    if (tid == 0) {
        for (int s = 0; s < 2; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(&full[s])), "r"(kAsync ? 1 : kThreads));
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(&empty[s])), "r"(kThreads));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
    float acc[kPerThread];
    for (int i = 0; i < kPerThread; ++i) acc[i] = 0.0f;
    const float v = 1.0f + rank;                                  // what the partner sends: 1 or 2
    // the thread's 4 row ids of chunk c, loaded a chunk ahead (so that no atomic waits for its id's load)
    int row_id[kPerThread / 4], row_next[kPerThread / 4];
    auto load_rows = [&](int c, int* dst) {
        for (int j = 0; j < kPerThread / 4; ++j)
            dst[j] = (kRed && c < chunks) ? ids[((long)blockIdx.x * chunks + c) * 64 + (j * kThreads + tid) / 16] : 0;
    };
    load_rows(0, row_id);
    for (int c = 0; c < chunks; ++c) {
        if (kRed) {
            load_rows(c + 1, row_next);
            for (int j = 0; j < kPerThread / 4; ++j) {
                float* dst = dkv + (long)row_id[j] * kRowFloats + (c % 9) * 64 + ((j * kThreads + tid) % 16) * 4;
                asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" :: "l"(dst), "f"(1.0f) : "memory");
            }
            for (int j = 0; j < kPerThread / 4; ++j) row_id[j] = row_next[j];
        }
        if (!kExchange) continue;
        const int s = c % 2, use = c / 2;
        // send: the partner's slot s is free once the partner read the chunk that used it before
        if (c >= 2) mbar_wait_cluster(smem_addr(&empty[s]), (use - 1) & 1);
        const uint32_t dst = mapa_peer(smem_addr(&slot[s][tid * 4]), peer);
        const uint32_t pfull = mapa_peer(smem_addr(&full[s]), peer);
        if (kAsync) {
            if (tid == 0)   // this CTA's own full barrier expects the partner's bytes of this use
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                             :: "r"(smem_addr(&full[s])), "r"(kChunkFloats * 4) : "memory");
            for (int j = 0; j < kPerThread / 4; ++j)
                asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %1, %1, %1}, [%2];"
                             :: "r"(dst + j * kThreads * 16), "f"(v), "r"(pfull) : "memory");
        } else {
            for (int j = 0; j < kPerThread / 4; ++j)
                asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %1, %1, %1};"
                             :: "r"(dst + j * kThreads * 16), "f"(v) : "memory");
            arrive_remote(pfull);
        }
        // receive the partner's chunk c in this CTA's slot s, then free it for the partner
        mbar_wait_cluster(smem_addr(&full[s]), use & 1);
        for (int j = 0; j < kPerThread / 4; ++j) {
            const float4 x = *reinterpret_cast<const float4*>(&slot[s][tid * 4 + j * kThreads * 4]);
            acc[4 * j] += x.x; acc[4 * j + 1] += x.y; acc[4 * j + 2] += x.z; acc[4 * j + 3] += x.w;
        }
        arrive_remote(mapa_peer(smem_addr(&empty[s]), peer));
    }
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
    if (!kExchange) return;
    float total = 0.0f;
    for (int i = 0; i < kPerThread; ++i) total += acc[i];
    out[blockIdx.x * kThreads + tid] = total;
}

int main(int argc, char** argv) {
    const int chunks = argc > 1 ? atoi(argv[1]) : 4096;
    const double energy_seconds = argc > 2 ? atof(argv[2]) : 0.0;
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int ctas = sms / 2 * 2;
    constexpr long kPoolRows = 32768;
    float* d_out;
    CK(cudaMalloc(&d_out, ctas * kThreads * sizeof(float)));
    float* d_dkv;
    CK(cudaMalloc(&d_dkv, kPoolRows * kRowFloats * sizeof(float)));
    // the backward's window ordering: chunk c of every CTA adds into the 4096-row window c * 8 / chunks
    const long n_ids = (long)ctas * chunks * 64;
    std::vector<int> ids(n_ids);
    std::mt19937 gen(5);
    std::uniform_int_distribution<int> pick(0, 4095);
    for (long i = 0; i < n_ids; ++i) ids[i] = pick(gen) + (int)(((i / 64) % chunks) * 8 / chunks) * 4096;
    int* d_ids;
    CK(cudaMalloc(&d_ids, n_ids * sizeof(int)));
    CK(cudaMemcpy(d_ids, ids.data(), n_ids * sizeof(int), cudaMemcpyHostToDevice));
    printf("# %d CTAs in 2-CTA clusters, 256 threads each, %d 16 KB chunks sent per CTA\n", ctas, chunks);
    const EnergyProbe energy(energy_seconds);
    printf("%-34s %8s %10s %s%s\n", "variant", "ms", "GB/s", "check", energy.columns());
    const char* names[] = {"st.shared::cluster", "st.async", "atomics only", "st.async + atomics"};
    for (int variant = 0; variant < 4; ++variant) {
        auto launch = [&]() {
            switch (variant) {
            case 0: exchange<false, true, false><<<ctas, kThreads>>>(chunks, d_out, d_dkv, d_ids); break;
            case 1: exchange<true, true, false><<<ctas, kThreads>>>(chunks, d_out, d_dkv, d_ids); break;
            case 2: exchange<true, false, true><<<ctas, kThreads>>>(chunks, d_out, d_dkv, d_ids); break;
            default: exchange<true, true, true><<<ctas, kThreads>>>(chunks, d_out, d_dkv, d_ids); break;
            }
        };
        const bool exchanges = variant != 2, reds = variant >= 2;
        CK(cudaMemset(d_dkv, 0, kPoolRows * kRowFloats * sizeof(float)));
        launch();
        CK(cudaDeviceSynchronize());
        bool ok = true;
        if (exchanges) {
            std::vector<float> h(ctas * kThreads);
            CK(cudaMemcpy(h.data(), d_out, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
            for (int b = 0; b < ctas; ++b)
                for (int t = 0; t < kThreads; ++t)   // CTA of rank r receives (1 + (r ^ 1)) per float
                    ok &= h[b * kThreads + t] == (float)chunks * kPerThread * (1 + ((b % 2) ^ 1));
        }
        if (reds) {
            std::vector<float> h(kPoolRows * kRowFloats);
            CK(cudaMemcpy(h.data(), d_dkv, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
            double total = 0;
            for (float x : h) total += x;
            ok &= total == (double)ctas * chunks * kChunkFloats;
        }
        const float best = best_ms(launch);
        // exchanged bytes (both directions) plus reduced bytes
        const double bytes = (double)ctas * chunks * kChunkFloats * 4 * ((exchanges ? 1 : 0) + (reds ? 1 : 0));
        printf("%-34s %8.3f %10.1f %s", names[variant], best, bytes / best / 1e6, ok ? "ok   " : "WRONG");
        energy.print(launch, bytes);
        printf("\n");
    }
    return 0;
}
