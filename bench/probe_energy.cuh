// Energy of a CUDA probe's launches from the GPU's total-energy counter (NVML, mJ), for probes whose variants are
// compared by energy per byte as well as by time: an H200 runs the sparse MLA kernels at its power cap, where a
// variant's time follows its energy. NVML is opened at run time (dlopen of the driver's libnvidia-ml.so.1), so the
// probe builds with plain nvcc; the counter updates every few tens of milliseconds, so each measurement runs for
// seconds. Device 0 (the probes run on one GPU).
#pragma once
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <dlfcn.h>
#include <thread>
#include "probe_timing.cuh"

struct Nvml {
    int (*init)() = nullptr;
    int (*handle_by_index)(unsigned, void**) = nullptr;
    int (*total_energy)(void*, unsigned long long*) = nullptr;
    void* dev = nullptr;

    Nvml() {
        void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
        if (!lib) { printf("NVML: %s\n", dlerror()); exit(1); }
        init = (int (*)())dlsym(lib, "nvmlInit_v2");
        handle_by_index = (int (*)(unsigned, void**))dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
        total_energy = (int (*)(void*, unsigned long long*))dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption");
        if (!init || !handle_by_index || !total_energy || init() != 0 || handle_by_index(0, &dev) != 0) {
            printf("NVML: no energy counter for device 0\n");
            exit(1);
        }
    }
    double joules() const {   // the counter, in J
        unsigned long long mj = 0;
        if (total_energy(dev, &mj) != 0) { printf("NVML: energy counter read failed\n"); exit(1); }
        return mj * 1e-3;
    }
};

struct EnergyRun {
    double joules_per_launch, watts, ms_per_launch;
    long launches;
};

// launch() back to back for at least `seconds` (synchronizing every 8 launches), the energy counter read around them.
template <typename Launch>
EnergyRun energy_run(const Nvml& nvml, Launch launch, double seconds) {
    using clock = std::chrono::steady_clock;
    CK(cudaDeviceSynchronize());
    const double e0 = nvml.joules();
    const auto t0 = clock::now();
    long n = 0;
    double elapsed = 0.0;
    while (elapsed < seconds) {
        launch();
        if (++n % 8 == 0) {
            CK(cudaDeviceSynchronize());
            elapsed = std::chrono::duration<double>(clock::now() - t0).count();
        }
    }
    CK(cudaDeviceSynchronize());
    elapsed = std::chrono::duration<double>(clock::now() - t0).count();
    const double joules = nvml.joules() - e0;
    CK(cudaGetLastError());
    return {joules / n, joules / elapsed, elapsed * 1e3 / n, n};
}

// The board's power with nothing running, over `seconds`.
inline double idle_watts(const Nvml& nvml, double seconds) {
    CK(cudaDeviceSynchronize());
    const double e0 = nvml.joules();
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    return (nvml.joules() - e0) / seconds;
}

// A probe's energy mode: with seconds > 0, NVML and the idle board's power (2 s, printed as a header line); with 0,
// off (every function below then does nothing).
struct EnergyProbe {
    Nvml* nvml = nullptr;
    double idle_w = 0.0, seconds = 0.0;

    explicit EnergyProbe(double seconds_) : seconds(seconds_) {
        if (seconds <= 0) return;
        nvml = new Nvml();
        idle_w = idle_watts(*nvml, 2.0);
        printf("# idle board: %.1f W; energy: %.1f s of back-to-back launches per variant\n", idle_w, seconds);
    }
    // the header of the columns `print` adds to a row
    const char* columns() const { return nvml ? "    J/launch      W   pJ/byte  pJ/byte above idle" : ""; }
    // launch() back to back for `seconds` under the counter: J per launch, W, pJ per byte of `bytes` moved per launch,
    // total and above the idle board, appended to the current row
    template <typename Launch>
    void print(Launch launch, double bytes) const {
        if (!nvml) return;
        const EnergyRun e = energy_run(*nvml, launch, seconds);
        const double above = e.joules_per_launch - idle_w * e.ms_per_launch * 1e-3;
        printf(" %10.4f %6.1f %9.2f %9.2f", e.joules_per_launch, e.watts, e.joules_per_launch / bytes * 1e12,
               above / bytes * 1e12);
    }
};
