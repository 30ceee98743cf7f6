// What other shim files use of saved-tensor parking (saved_offload.cpp).
#pragma once

namespace sk::saved_offload {

// While alive, the tensors autograd saves on this thread get no parking hooks: for saves whose
// backward decides by who holds them (a gradient written into the saved tensor's memory where
// nothing else reads it), which the backward's reading of an unpacked alias would change.
class KeptOnDevice {
 public:
  KeptOnDevice();
  ~KeptOnDevice();
  KeptOnDevice(const KeptOnDevice&) = delete;
  KeptOnDevice& operator=(const KeptOnDevice&) = delete;

 private:
  bool previous_;
};

}  // namespace sk::saved_offload
