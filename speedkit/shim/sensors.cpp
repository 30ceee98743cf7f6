// The GPU's sensors through NVML (libnvidia-ml, part of the driver, loaded at run time by loader.h
// as libcuda is): its SM clock, board power, power limit and the reasons its clocks are held down.
// A timed step on a Hopper board often runs at its power limit, where the clock (and so every
// kernel's time) follows the step's energy; the benchmark runner samples these to say so.
//
// NVML numbers devices its own way; a CUDA device is found by its PCI bus id, so CUDA_VISIBLE_DEVICES
// and CUDA's device order do not matter. NVML's few types are declared here (its header is not in
// the torch wheel); their layout is NVML's stable ABI.
#include "loader.h"
#include "shim.h"

#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#if SK_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace sk::sensors {

#if SK_WITH_CUDA
namespace {

using Return = int;  // nvmlReturn_t; 0 is NVML_SUCCESS
using Device = struct nvmlDevice_st*;
constexpr int kClockSm = 1;  // NVML_CLOCK_SM

struct Api {
  Return (*Init)();
  const char* (*ErrorString)(Return);
  Return (*DeviceGetHandleByPciBusId)(const char*, Device*);
  Return (*DeviceGetClockInfo)(Device, int, unsigned*);
  Return (*DeviceGetMaxClockInfo)(Device, int, unsigned*);
  Return (*DeviceGetPowerUsage)(Device, unsigned*);
  Return (*DeviceGetEnforcedPowerLimit)(Device, unsigned*);
  // nvmlDeviceGetCurrentClocksEventReasons; drivers before 535 name it ...ThrottleReasons.
  Return (*DeviceGetClockEventReasons)(Device, unsigned long long*);
  // Volta and newer; absent or unsupported elsewhere.
  Return (*DeviceGetTotalEnergyConsumption)(Device, unsigned long long*);
};

void check(const Api& api, Return result, const char* what) {
  if (result == 0) return;
  const char* message = api.ErrorString ? api.ErrorString(result) : nullptr;
  throw std::runtime_error(std::string(what) + ": " + (message ? message : "unknown NVML error"));
}

const Api& api() {
  return loader::once<Api>([] {
    const auto library = loader::Library::open("NVML (the NVIDIA driver's management library)", {"libnvidia-ml.so.1"});
    Api api{};
    library.bind(api.ErrorString, "nvmlErrorString");
    library.bind(api.Init, "nvmlInit_v2");
    library.bind(api.DeviceGetHandleByPciBusId, "nvmlDeviceGetHandleByPciBusId_v2");
    library.bind(api.DeviceGetClockInfo, "nvmlDeviceGetClockInfo");
    library.bind(api.DeviceGetMaxClockInfo, "nvmlDeviceGetMaxClockInfo");
    library.bind(api.DeviceGetPowerUsage, "nvmlDeviceGetPowerUsage");
    library.bind(api.DeviceGetEnforcedPowerLimit, "nvmlDeviceGetEnforcedPowerLimit");
    if (!library.bind_optional(api.DeviceGetClockEventReasons, "nvmlDeviceGetCurrentClocksEventReasons")) {
      library.bind(api.DeviceGetClockEventReasons, "nvmlDeviceGetCurrentClocksThrottleReasons");
    }
    library.bind_optional(api.DeviceGetTotalEnergyConsumption, "nvmlDeviceGetTotalEnergyConsumption");
    // Initialised once for the process and never shut down: NVML counts its users, and the
    // runner's sampling thread may read while the process exits.
    check(api, api.Init(), "nvmlInit");
    return api;
  });
}

// NVML's handle for CUDA device `index`, looked up once by its PCI bus id.
Device device(int index) {
  static std::mutex mutex;
  static std::map<int, Device> handles;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto found = handles.find(index); found != handles.end()) return found->second;
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index));
  char bus_id[32];
  std::snprintf(bus_id, sizeof(bus_id), "%08x:%02x:%02x.0", p->pciDomainID, p->pciBusID, p->pciDeviceID);
  Device handle = nullptr;
  check(api(), api().DeviceGetHandleByPciBusId(bus_id, &handle), "nvmlDeviceGetHandleByPciBusId");
  handles.emplace(index, handle);
  return handle;
}

}  // namespace
#endif

}  // namespace sk::sensors

extern "C" {

int sk_gpu_sensors_read(int index, sk_gpu_reading* out) {
  SK_CUDA_TRY({
    using namespace sk::sensors;
    const Api& nvml = api();
    const Device d = device(index);
    std::memset(out, 0, sizeof(*out));
    unsigned value = 0;
    check(nvml, nvml.DeviceGetClockInfo(d, kClockSm, &value), "nvmlDeviceGetClockInfo");
    out->sm_clock_mhz = value;
    check(nvml, nvml.DeviceGetMaxClockInfo(d, kClockSm, &value), "nvmlDeviceGetMaxClockInfo");
    out->max_sm_clock_mhz = value;
    check(nvml, nvml.DeviceGetPowerUsage(d, &value), "nvmlDeviceGetPowerUsage");
    out->power_mw = value;
    check(nvml, nvml.DeviceGetEnforcedPowerLimit(d, &value), "nvmlDeviceGetEnforcedPowerLimit");
    out->power_limit_mw = value;
    unsigned long long reasons = 0;
    check(nvml, nvml.DeviceGetClockEventReasons(d, &reasons), "nvmlDeviceGetCurrentClocksEventReasons");
    out->clock_event_reasons = reasons;
    unsigned long long energy = 0;
    // A board that does not count its energy reads 0: the power readings stand in.
    if (nvml.DeviceGetTotalEnergyConsumption != nullptr && nvml.DeviceGetTotalEnergyConsumption(d, &energy) == 0) {
      out->energy_mj = energy;
    }
  })
}

}  // extern "C"
