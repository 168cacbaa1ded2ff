// Device guard for the remote_accelerator (PrivateUse1) device.
//
// PyTorch's Python-level guard for a Python backend knows one device only, so
// autograd on remote_accelerator:1 hits an internal assert and set_device is
// ignored. This guard keeps a thread-local current device and stream per the
// DeviceGuardImplInterface contract and reports a device count that covers every
// device Genie connected to (deviceCount never throws). Its streams and events
// are Genie's (genie/frontend/streams.py, through hooks): torch.Stream,
// torch.Event, torch.accelerator.synchronize() and the autograd engine's stream
// guards order and wait for the remote work itself, as they do on CUDA.
#include <ATen/EmptyTensor.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#if GENIE_TORCH_VERSION >= 213
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/GraphImplInterface.h>
#include <c10/core/CachingDeviceAllocator.h>
#endif
#include <c10/core/GeneratorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/autograd/engine.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

std::atomic<int> g_device_count{1};
// The autograd engine sizes its per-device queues from deviceCount() once, at the
// first backward of the process; devices connected later (genie.init with more
// daemons) must still fit, so the count it sees never drops below this floor.
constexpr int kDeviceCountFloor = 16;
thread_local c10::DeviceIndex t_device = 0;
thread_local std::unordered_map<c10::DeviceIndex, c10::StreamId> t_streams;
std::atomic<c10::StreamId> g_next_stream{1};

// Holds the GIL for a call into the hooks (THPGenerator's methods hold it already; other C++
// callers may not). Released on every way out, exceptions included.
struct GilHeld {
  PyGILState_STATE state = PyGILState_Ensure();
  ~GilHeld() { PyGILState_Release(state); }
};

// The pending Python exception of a hook, thrown on as torch's own C++ throws one: torch's
// bindings restore a python_error as they return to Python, so the program gets the hook's
// exception itself, type and all (a Ctrl-C in a hook stays a KeyboardInterrupt, not a
// RuntimeError with an empty message). The GIL is held.
[[noreturn]] void throw_hook_error() {
  TORCH_CHECK(PyErr_Occurred() != nullptr, "remote_accelerator: a hook into Genie failed");
  python_error error;
  error.persist();  // taken out of this thread's error indicator: nothing on the way up clears it
  throw error;
}

// Genie's Python side of streams and events (genie.frontend.streams; borrowed: it keeps both
// alive for the life of the process, see genie_set_stream_hooks).
// stream hook(action, device index, stream id) -> truth: "current" (a C++ caller made the stream
// current on this thread), "query", "synchronize", "synchronize_device".
PyObject* g_stream_hook = nullptr;
// event hook(action, event, other event, device index, stream id, timing) -> object: "record"
// (returns the Genie event, made when `event` is None), "wait", "query", "synchronize", "elapsed".
PyObject* g_event_hook = nullptr;
constexpr const char* kNoStreamHooks =
    "remote_accelerator streams and events need Genie's device module (import genie)";

// Whether a hook's answer is true; the answer (a new reference, or nullptr with the hook's error
// pending) is dropped, the error raised. The GIL is held.
bool truth_of(PyObject* answer) {
  if (answer == nullptr) throw_hook_error();
  int truth = PyObject_IsTrue(answer);
  Py_DECREF(answer);
  if (truth < 0) throw_hook_error();
  return truth == 1;
}

// The stream hook's answer: a new reference, or nullptr with its error pending. The GIL is held.
PyObject* stream_hook_answer(const char* action, c10::DeviceIndex device, c10::StreamId stream) {
  return PyObject_CallFunction(g_stream_hook, "siL", action, static_cast<int>(device), static_cast<long long>(stream));
}

bool call_stream_hook(const char* action, c10::DeviceIndex device, c10::StreamId stream) {
  TORCH_CHECK(g_stream_hook != nullptr, kNoStreamHooks);
  GilHeld gil;
  return truth_of(stream_hook_answer(action, device, stream));
}

// A torch.Event on remote_accelerator: the Genie event it was last recorded as (a new reference).
struct GuardEvent {
  PyObject* genie = nullptr;
};

// The hook's answer (a new reference); the GIL is held by the caller.
PyObject* call_event_hook(const char* action, PyObject* event, PyObject* other, c10::DeviceIndex device,
                          c10::StreamId stream, bool timing) {
  TORCH_CHECK(g_event_hook != nullptr, kNoStreamHooks);
  PyObject* answer = PyObject_CallFunction(g_event_hook, "sOOiLi", action, event ? event : Py_None,
                                           other ? other : Py_None, static_cast<int>(device),
                                           static_cast<long long>(stream), timing ? 1 : 0);
  if (answer == nullptr) throw_hook_error();
  return answer;
}

bool event_hook_truth(const char* action, void* event) {
  GilHeld gil;
  return truth_of(call_event_hook(action, static_cast<GuardEvent*>(event)->genie, nullptr, -1, 0, false));
}

struct RemoteGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;

  c10::DeviceType type() const override { return kType; }

  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kType, t_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kType, "expected a remote_accelerator device, got ", d);
    TORCH_CHECK(d.index() >= 0 && d.index() < g_device_count.load(),
                "remote_accelerator:", static_cast<int>(d.index()), " does not exist (",
                g_device_count.load(), " connected)");
    t_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { t_device = d.index(); }

  c10::Stream getStream(c10::Device d) const override {
    auto it = t_streams.find(d.index());
    c10::StreamId id = it == t_streams.end() ? 0 : it->second;
    return c10::Stream(c10::Stream::UNSAFE, d, id);
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override {
    // torch.Stream(device="remote_accelerator") names no index: the current device's, as on CUDA.
    c10::Device on(kType, d.has_index() ? d.index() : t_device);
    return c10::Stream(c10::Stream::UNSAFE, on, g_next_stream.fetch_add(1));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*high_priority*/) const override {
    return getNewStream(d, 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream old = getStream(s.device());
    t_streams[s.device_index()] = s.id();
    // Genie's ops follow this thread's current stream (torch.accelerator.set_stream, `with
    // stream:`, and the autograd engine running each backward node on its forward's stream).
    // Called from guards' destructors too: a failure here is dropped, not thrown.
    if (old.id() != s.id() && g_stream_hook != nullptr) {
      GilHeld gil;
      PyObject* answer = stream_hook_answer("current", s.device_index(), s.id());
      if (answer == nullptr) PyErr_Clear();
      Py_XDECREF(answer);
    }
    return old;
  }

  c10::DeviceIndex deviceCount() const noexcept override {
    int n = g_device_count.load();
    return static_cast<c10::DeviceIndex>(n > kDeviceCountFloor ? n : kDeviceCountFloor);
  }

#if GENIE_TORCH_VERSION >= 213
  // torch.accelerator.get_device_capability(): the dtypes a remote tensor can have and be converted
  // between, the wire's (genie/transport/tensors.py DTYPE_NAMES; a test keeps the two equal).
  // Quantized and sub-byte "bits" dtypes are not among them.
  c10::DeviceCapability getDeviceCapability(c10::Device /*device*/) const override {
    c10::DeviceCapability cap;
    cap.capability_data.capability_bits = 0;
#define GENIE_WIRE_DTYPE(name) cap.capability_data.capability_bits |= 1ULL << c10::kIndex_##name;
    GENIE_WIRE_DTYPE(Byte) GENIE_WIRE_DTYPE(Char) GENIE_WIRE_DTYPE(Short) GENIE_WIRE_DTYPE(Int)
    GENIE_WIRE_DTYPE(Long) GENIE_WIRE_DTYPE(UInt16) GENIE_WIRE_DTYPE(UInt32) GENIE_WIRE_DTYPE(UInt64)
    GENIE_WIRE_DTYPE(Bool) GENIE_WIRE_DTYPE(Half) GENIE_WIRE_DTYPE(Float) GENIE_WIRE_DTYPE(Double)
    GENIE_WIRE_DTYPE(BFloat16) GENIE_WIRE_DTYPE(ComplexHalf) GENIE_WIRE_DTYPE(ComplexFloat)
    GENIE_WIRE_DTYPE(ComplexDouble) GENIE_WIRE_DTYPE(Float8_e5m2) GENIE_WIRE_DTYPE(Float8_e4m3fn)
    GENIE_WIRE_DTYPE(Float8_e5m2fnuz) GENIE_WIRE_DTYPE(Float8_e4m3fnuz) GENIE_WIRE_DTYPE(Float8_e8m0fnu)
    GENIE_WIRE_DTYPE(Float4_e2m1fn_x2)
#undef GENIE_WIRE_DTYPE
    return cap;
  }
#endif

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex /*device_index*/,
              const c10::EventFlag flag) const override {
    GilHeld gil;
    auto* guard_event = static_cast<GuardEvent*>(*event);
    PyObject* recorded = call_event_hook("record", guard_event ? guard_event->genie : nullptr, nullptr,
                                         stream.device_index(), stream.id(),
                                         flag == c10::EventFlag::BACKEND_DEFAULT);
    if (guard_event == nullptr) {
      *event = guard_event = new GuardEvent;
    }
    Py_XDECREF(guard_event->genie);
    guard_event->genie = recorded;
  }
  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) return;  // never recorded: nothing to wait for, as with CUDA events
    GilHeld gil;
    Py_DECREF(call_event_hook("wait", static_cast<GuardEvent*>(event)->genie, nullptr, stream.device_index(),
                              stream.id(), false));
  }
  bool queryEvent(void* event) const override { return event == nullptr || event_hook_truth("query", event); }
  void destroyEvent(void* event, const c10::DeviceIndex /*device_index*/) const noexcept override {
    auto* guard_event = static_cast<GuardEvent*>(event);
    if (guard_event == nullptr) return;
    // At interpreter exit the Genie event is left to Python's own teardown.
#if PY_VERSION_HEX >= 0x030D0000
    bool finalizing = Py_IsFinalizing();
#else
    bool finalizing = _Py_IsFinalizing();
#endif
    if (guard_event->genie != nullptr && Py_IsInitialized() && !finalizing) {
      GilHeld gil;
      Py_DECREF(guard_event->genie);
    }
    delete guard_event;
  }
  bool queryStream(const c10::Stream& stream) const override {
    return call_stream_hook("query", stream.device_index(), stream.id());
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    call_stream_hook("synchronize", stream.device_index(), stream.id());
  }
  void synchronizeEvent(void* event) const override {
    if (event != nullptr) event_hook_truth("synchronize", event);
  }
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    call_stream_hook("synchronize_device", device_index, 0);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(start && end, "both events must be recorded before calling elapsed_time()");
    GilHeld gil;
    PyObject* answer = call_event_hook("elapsed", static_cast<GuardEvent*>(start)->genie,
                                       static_cast<GuardEvent*>(end)->genie, -1, 0, false);
    double ms = PyFloat_AsDouble(answer);
    Py_DECREF(answer);
    if (ms == -1.0 && PyErr_Occurred()) throw_hook_error();
    return ms;
  }
};

// A torch.Generator(device="remote_accelerator"). Its random stream lives on the daemon: this
// object holds what the client knows, a seed and a count of (re)seedings, under an id unique in
// this process. Genie reads them (genie_generator_info) when an op draws from the generator and,
// when the count moved since the daemon last heard, queues a seed for the daemon's twin first.
// Its position in the stream exists only on the daemon: get_state/set_state ask Genie's Python
// side (hooks registered by genie_set_generator_state_hooks) to read or set the twin's state in
// program order; offsets and clones are refused.
std::atomic<int64_t> g_next_generator{1};
// torch.Generator() starts from this seed on every device (CPU and CUDA alike): so does this one.
constexpr uint64_t kDefaultSeed = 67280421310721ULL;
constexpr const char* kNoGeneratorState =
    "a remote_accelerator generator's position lives on the genie-daemon: offsets and clones are "
    "not supported. Save and restore it with get_state()/set_state(), or re-seed it with manual_seed(s)";
constexpr const char* kNoStateHooks =
    "remote_accelerator generator state needs Genie's device module (import genie)";

// get(id, seedings, seed, device index) -> bytes; set(id, seedings, seed, device index, bytes).
// Borrowed: genie.frontend.device keeps both alive for the life of the process.
PyObject* g_get_state_hook = nullptr;
PyObject* g_set_state_hook = nullptr;

// Ids of generators destroyed since Genie last asked (genie_generators_dropped): their twins
// on the daemons can go. (Python wrappers of one generator come and go, so only this side knows.)
std::mutex g_dropped_mutex;
std::vector<int64_t> g_dropped;

struct RemoteGeneratorImpl final : public c10::GeneratorImpl {
  explicit RemoteGeneratorImpl(c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, index),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        uid(g_next_generator.fetch_add(1)) {}
  ~RemoteGeneratorImpl() override {
    std::lock_guard<std::mutex> lock(g_dropped_mutex);
    g_dropped.push_back(uid);
  }

  void set_current_seed(uint64_t s) override {
    seed_.store(s);
    version.fetch_add(1);
  }
  uint64_t current_seed() const override { return seed_.load(); }
  uint64_t seed() override {
    uint64_t s = c10::detail::getNonDeterministicRandom();
    set_current_seed(s);
    return s;
  }
  void set_offset(uint64_t /*offset*/) override { TORCH_CHECK(false, kNoGeneratorState); }
  uint64_t get_offset() const override { TORCH_CHECK(false, kNoGeneratorState); }
  // The twin's state, after every op queued before this call (a CPU uint8 tensor, as CUDA's is).
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    TORCH_CHECK(g_get_state_hook != nullptr, kNoStateHooks);
    GilHeld gil;
    PyObject* answer = PyObject_CallFunction(
        g_get_state_hook, "LLKi", static_cast<long long>(uid), static_cast<long long>(version.load()),
        static_cast<unsigned long long>(current_seed()), static_cast<int>(device().index()));
    if (answer == nullptr) throw_hook_error();
    char* bytes = nullptr;
    Py_ssize_t n = 0;
    if (PyBytes_AsStringAndSize(answer, &bytes, &n) != 0) {
      Py_DECREF(answer);
      throw_hook_error();
    }
    at::TensorBase state = at::detail::empty_cpu({static_cast<int64_t>(n)}, c10::ScalarType::Byte);
    std::memcpy(state.mutable_data_ptr(), bytes, static_cast<size_t>(n));
    Py_DECREF(answer);
    return state.getIntrusivePtr();
  }
  // Queues the twin's new state after the ops queued so far (PyTorch checked it is a ByteTensor).
  void set_state(const c10::TensorImpl& state) override {
    TORCH_CHECK(g_set_state_hook != nullptr, kNoStateHooks);
    TORCH_CHECK(state.device().is_cpu() && state.dtype().itemsize() == 1 && state.is_contiguous(),
                "a generator state is a contiguous CPU uint8 tensor, as get_state() returns");
    GilHeld gil;
    PyObject* bytes = PyBytes_FromStringAndSize(static_cast<const char*>(state.data()),
                                                static_cast<Py_ssize_t>(state.numel()));
    if (bytes == nullptr) throw_hook_error();
    PyObject* answer = PyObject_CallFunction(
        g_set_state_hook, "LLKiO", static_cast<long long>(uid), static_cast<long long>(version.load()),
        static_cast<unsigned long long>(current_seed()), static_cast<int>(device().index()), bytes);
    Py_DECREF(bytes);
    if (answer == nullptr) throw_hook_error();
    Py_DECREF(answer);
  }
  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }

  const int64_t uid;
  std::atomic<int64_t> version{1};  // 1: the daemon has not heard the starting seed yet

 private:
  RemoteGeneratorImpl* clone_impl() const override { TORCH_CHECK(false, kNoGeneratorState); }
  std::atomic<uint64_t> seed_{kDefaultSeed};
};

// Pinned host memory where this process has no GPU: ordinary memory, page-locking would help
// no copy to a remote device, kept in a registry so that is_pinned() is true for it and for views
// into it, as for any backend's pinned memory (PyTorch's own test backend does the same). It is
// what a non_blocking copy may lend without a snapshot (genie.frontend.transfers._copy_), and what
// DDP's reducer asserts of its staging buffer for a PrivateUse1 device.
struct PinnedHostMemory final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = c10::alloc_cpu(n > 0 ? n : 1);  // a unique address even when empty: is_pinned() holds
    {
      std::lock_guard<std::mutex> lock(mutex());
      blocks()[reinterpret_cast<uintptr_t>(p)] = n > 0 ? n : 1;
    }
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  static bool contains(const void* ptr) {
    const auto address = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mutex());
    auto it = blocks().upper_bound(address);
    if (it == blocks().begin()) return false;
    --it;
    return address < it->first + it->second;
  }

 private:
  static void release(void* p) {
    {
      std::lock_guard<std::mutex> lock(mutex());
      blocks().erase(reinterpret_cast<uintptr_t>(p));
    }
    c10::free_cpu(p);
  }
  // Function-local statics: alive for every deleter, whatever the order of destruction at exit.
  static std::mutex& mutex() {
    static auto* m = new std::mutex();
    return *m;
  }
  static std::map<uintptr_t, size_t>& blocks() {
    static auto* b = new std::map<uintptr_t, size_t>();
    return *b;
  }
};
PinnedHostMemory g_pinned_host;

// Backend hooks. PyTorch makes a registered PrivateUse1 backend the current accelerator, so
// `t.pin_memory()` and DataLoader(pin_memory=True) ask these hooks for pinned memory: CUDA's
// page-locked allocator where this process has a GPU (the same buffers `torch.cuda` would give,
// which local CUDA copies gain from), else PinnedHostMemory.
struct RemoteHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override { return true; }
  void init() const override {}
  bool isPinnedPtr(const void* data) const override {
    const auto& cuda = at::detail::getCUDAHooks();
    return cuda.hasCUDA() ? cuda.isPinnedPtr(data) : PinnedHostMemory::contains(data);
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    const auto& cuda = at::detail::getCUDAHooks();
    return cuda.hasCUDA() ? cuda.getPinnedMemoryAllocator() : &g_pinned_host;
  }
  // The default generator is this client's on the daemon, driven by torch.manual_seed and
  // torch.remote_accelerator.{manual_seed,get_rng_state,set_rng_state}; no object here stands for it.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(false, kNoDefaultGenerator);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    // The index is checked where the generator is used: daemons may not be connected yet.
    return at::make_generator<RemoteGeneratorImpl>(device_index < 0 ? t_device : device_index);
  }
  static constexpr const char* kNoDefaultGenerator =
      "remote_accelerator's default generator lives on the genie-daemon: seed it with "
      "torch.manual_seed(s) or torch.remote_accelerator.manual_seed(s), save and restore it with "
      "torch.remote_accelerator.get_rng_state() / set_rng_state(), or make your own with "
      "torch.Generator(device=\"remote_accelerator\")";
};

// Storage for remote_accelerator tensors lives on a daemon: this process has none to hand out.
// Without an allocator registered for the device, PyTorch used a null one and the process
// crashed (torch.UntypedStorage(n, device=...); torch.load(f, map_location="remote_accelerator")
// before genie/frontend/serialization.py handled it).
// Remote tensors never reach it: they are wrappers whose metadata-only storage PyTorch makes itself.
constexpr const char* kNoStorage =
    "remote_accelerator tensors live on a genie-daemon; this process cannot allocate or copy "
    "storage for them (torch.UntypedStorage on the device, storage.to(device=...), a map_location "
    "function moving storages). Give torch.load the device itself: torch.load(f, "
    "map_location=\"remote_accelerator\") (or a torch.device, or a dict naming it), or load to the "
    "CPU and move the tensors with .to(\"remote_accelerator\") or model.load_state_dict(...)";

// torch.accelerator.memory_allocated() and its siblings (memory_stats, max_memory_allocated,
// memory_reserved, reset_peak_memory_stats, empty_cache, get_memory_info) ask the device's
// allocator, which must be a c10::DeviceAllocator: with a plain one every such call stopped in
// an internal assert ("Allocator for remote_accelerator is not a DeviceAllocator"). The figures
// are the daemon's, through Genie's Python side: hook(action, device index) returns a tuple of
// ints ("stats": allocated, allocated peak, reserved, reserved peak; "info": free, total) or ().
// Borrowed: genie.frontend.device keeps it alive for the life of the process.
PyObject* g_memory_hook = nullptr;

std::vector<int64_t> call_memory_hook(const char* action, c10::DeviceIndex device) {
  TORCH_CHECK(g_memory_hook != nullptr, "remote_accelerator memory figures need Genie's device module (import genie)");
  GilHeld gil;
  PyObject* answer = PyObject_CallFunction(g_memory_hook, "si", action, static_cast<int>(device));
  if (answer == nullptr) throw_hook_error();
  std::vector<int64_t> values;
  Py_ssize_t n = PyTuple_Check(answer) ? PyTuple_GET_SIZE(answer) : -1;
  for (Py_ssize_t i = 0; i < n; ++i) {
    long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(answer, i));
    if (v == -1 && PyErr_Occurred()) break;
    values.push_back(static_cast<int64_t>(v));
  }
  Py_DECREF(answer);
  if (PyErr_Occurred()) throw_hook_error();
  TORCH_CHECK(n >= 0, "remote_accelerator memory hook: expected a tuple of integers");
  return values;
}

#if GENIE_TORCH_VERSION >= 213
using AllocatorBase = c10::DeviceAllocator;
#else
using AllocatorBase = c10::Allocator;  // older PyTorch: torch.accelerator's memory calls are not offered
#endif

struct NoStorageAllocator final : public AllocatorBase {
  c10::DataPtr allocate(size_t /*n*/) override { TORCH_CHECK(false, kNoStorage); }
  void copy_data(void* /*dest*/, const void* /*src*/, std::size_t /*count*/) const override {
    TORCH_CHECK(false, kNoStorage);
  }
#if GENIE_TORCH_VERSION >= 213
  bool initialized() override { return g_memory_hook != nullptr; }
  void emptyCache(c10::MempoolId_t /*mempool_id*/) override { call_memory_hook("empty_cache", -1); }
  // No remote storage is held in this process, so there is no block to keep from reuse here.
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}
  // The daemon reports bytes allocated and reserved (now and their peaks) for its device; it
  // counts no allocation events, so those counters, and the cumulative ones, stay 0.
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    std::vector<int64_t> v = call_memory_hook("stats", device);
    TORCH_CHECK(v.size() == 4, "remote_accelerator memory hook: stats must be 4 integers");
    c10::CachingDeviceAllocator::DeviceStats stats;
    constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    stats.allocated_bytes[all].current = v[0];
    stats.allocated_bytes[all].peak = v[1];
    stats.reserved_bytes[all].current = v[2];
    stats.reserved_bytes[all].peak = v[3];
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex /*device*/) override {}  // none is kept (see above)
  void resetPeakStats(c10::DeviceIndex device) override { call_memory_hook("reset_peak", device); }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    std::vector<int64_t> v = call_memory_hook("info", device);
    TORCH_CHECK(v.size() == 2, "remote_accelerator memory hook: info must be 2 integers");
    return {static_cast<size_t>(v[0]), static_cast<size_t>(v[1])};
  }
#endif
};

#if GENIE_TORCH_VERSION >= 213
// torch.accelerator.empty_host_cache() asks the accelerator's host (pinned) allocator; with none
// registered for PrivateUse1, PyTorch dereferenced a null one and the process crashed. Pinned
// memory for remote_accelerator is CUDA's where this process has a GPU (RemoteHooks): this one
// hands its calls to CUDA's host allocator then; otherwise it is PinnedHostMemory's and keeps
// no cache (nothing to empty, nothing counted).
struct RemoteHostAllocator final : public at::HostAllocator {
  static at::HostAllocator* cuda() {
    return at::detail::getCUDAHooks().hasCUDA() ? at::getHostAllocator(c10::DeviceType::CUDA) : nullptr;
  }
  c10::DataPtr allocate(size_t n) override {
    at::HostAllocator* a = cuda();
    return a != nullptr ? a->allocate(n) : g_pinned_host.allocate(n);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  bool record_event(void* ptr, void* ctx, c10::Stream stream) override {
    at::HostAllocator* a = stream.device_type() == c10::DeviceType::CUDA ? cuda() : nullptr;
    return a != nullptr && a->record_event(ptr, ctx, stream);
  }
  void empty_cache() override {
    if (at::HostAllocator* a = cuda()) a->empty_cache();
  }
  at::HostStats get_stats() override {
    at::HostAllocator* a = cuda();
    return a != nullptr ? a->get_stats() : at::HostStats{};
  }
  void reset_accumulated_stats() override {
    if (at::HostAllocator* a = cuda()) a->reset_accumulated_stats();
  }
  void reset_peak_stats() override {
    if (at::HostAllocator* a = cuda()) a->reset_peak_stats();
  }
};
#endif

#if GENIE_TORCH_VERSION >= 213
// torch.accelerator.Graph on remote_accelerator: a genie.Graph recorded without running (as a CUDA
// graph's capture runs nothing) and replayed on the daemon, through Genie's Python side:
// hook(action, state, path) with "begin" (returns the state), "end", "replay", "reset", "dump".
// Borrowed: genie.frontend.graphs keeps it alive for the life of the process.
PyObject* g_graph_hook = nullptr;
std::atomic<uint64_t> g_next_graph{1};

struct RemoteGraphImpl final : public at::GraphImplInterface {
  explicit RemoteGraphImpl(const at::GraphImplArgs& /*args*/) : id_(g_next_graph.fetch_add(1)) {}
  ~RemoteGraphImpl() override {
    if (state_ != nullptr && Py_IsInitialized()) {
      GilHeld gil;
      Py_DECREF(state_);
    }
  }
  // One capture per graph, as a CUDA graph: reset() before capturing again. The capture mode is
  // not used: capture records this thread's ops on its current device, whatever other threads do.
  void capture_begin(at::MempoolId_t /*pool*/, at::GraphCaptureMode /*capture_mode*/) override {
    TORCH_CHECK(state_ == nullptr, "this graph already holds a capture: reset() it, or make a new one");
    GilHeld gil;
    state_ = call("begin", Py_None, "");
  }
  void capture_end() override {
    TORCH_CHECK(state_ != nullptr, "capture_end() without capture_begin()");
    GilHeld gil;
    Py_DECREF(call("end", state_, ""));
  }
  void instantiate() override {}  // the daemon checks the program when the capture ends
  void replay() override {
    TORCH_CHECK(state_ != nullptr, "replay() of a graph that captured nothing");
    GilHeld gil;
    Py_DECREF(call("replay", state_, ""));
  }
  void reset() override {
    if (state_ == nullptr) return;
    GilHeld gil;
    PyObject* state = state_;
    state_ = nullptr;
    PyObject* answer = PyObject_CallFunction(g_graph_hook, "sOs", "reset", state, "");
    Py_DECREF(state);
    if (answer == nullptr) throw_hook_error();
    Py_DECREF(answer);
  }
  at::MempoolId_t pool() const override { return {0, id_}; }  // each graph its own (Genie keeps no pools)
  void enable_debug_mode() override { debug_ = true; }
  // One line per recorded op, in order.
  void debug_dump(const std::string& path) override {
    TORCH_CHECK(debug_, "debug_dump() needs enable_debug_mode() first");
    TORCH_CHECK(state_ != nullptr, "debug_dump() of a graph that captured nothing");
    GilHeld gil;
    Py_DECREF(call("dump", state_, path.c_str()));
  }

 private:
  // The hook's answer (a new reference); the GIL is held.
  PyObject* call(const char* action, PyObject* state, const char* path) const {
    TORCH_CHECK(g_graph_hook != nullptr, "remote_accelerator graphs need Genie's device module (import genie)");
    PyObject* answer = PyObject_CallFunction(g_graph_hook, "sOs", action, state, path);
    if (answer == nullptr) throw_hook_error();
    return answer;
  }
  const uint64_t id_;
  PyObject* state_ = nullptr;
  bool debug_ = false;
};
#endif

// The autograd engine's state, read and mended through a class derived from it (the standard lets a
// derived class name its base's protected members). The engine sizes its per-device queues once, at
// the first backward of the process, from the device guards registered then: a backward run before
// `import genie` leaves none for remote_accelerator, and every remote backward after it fails an
// internal assert ("device_ready_queues_.size()").
struct AutogradEngineAccess : torch::autograd::Engine {
  // Whether the engine has started (its first step is making the reentrant-backward pool).
  static bool started(torch::autograd::Engine& engine) {
    return (engine.*(&AutogradEngineAccess::thread_pool_shared_)) != nullptr;
  }
  static size_t device_queues(torch::autograd::Engine& engine) {
    return (engine.*(&AutogradEngineAccess::device_ready_queues_)).size();
  }
  static void start_threads(torch::autograd::Engine& engine) {
    (engine.*(&AutogradEngineAccess::start_device_threads))();
  }
};

}  // namespace

extern "C" {
// Registers the hooks above for PrivateUse1: 0 on success, 1 if PyTorch refused (hooks already
// registered). Call before anything registers other hooks (they can be registered only once).
int genie_install_hooks() {
  try {
    at::RegisterPrivateUse1HooksInterface(new RemoteHooks());  // leaked on purpose, like the guard
    return 0;
  } catch (const std::exception&) {
    return 1;
  }
}
// What Genie needs of a torch.Generator (the Python object) an op draws from: out = [id, number of
// seedings, seed's bits]. 0 for a remote_accelerator generator, 1 for any other (out untouched).
// The caller passes a live torch.Generator and holds the GIL.
int genie_generator_info(PyObject* generator, int64_t* out) {
  const at::Generator& gen = reinterpret_cast<THPGenerator*>(generator)->cdata;
  if (!gen.defined() || gen.device().type() != c10::DeviceType::PrivateUse1) return 1;
  auto* impl = dynamic_cast<RemoteGeneratorImpl*>(gen.unsafeGetGeneratorImpl());
  if (impl == nullptr) return 1;
  out[0] = impl->uid;
  out[1] = impl->version.load();
  out[2] = static_cast<int64_t>(impl->current_seed());
  return 0;
}
// Moves up to `capacity` ids of destroyed generators into `out`; how many it moved.
int genie_generators_dropped(int64_t* out, int capacity) {
  std::lock_guard<std::mutex> lock(g_dropped_mutex);
  int n = 0;
  while (n < capacity && !g_dropped.empty()) {
    out[n++] = g_dropped.back();
    g_dropped.pop_back();
  }
  return n;
}
// Genie's Python functions behind get_state/set_state (borrowed: the caller keeps them alive).
void genie_set_generator_state_hooks(PyObject* get, PyObject* set) {
  g_get_state_hook = get;
  g_set_state_hook = set;
}
// Genie's Python functions behind streams and events (see g_stream_hook; borrowed).
void genie_set_stream_hooks(PyObject* stream, PyObject* event) {
  g_stream_hook = stream;
  g_event_hook = event;
}
// Genie made `stream` current on `device` for this thread (no hook is called back).
void genie_set_current_stream(int device, int64_t stream) {
  t_streams[static_cast<c10::DeviceIndex>(device)] = static_cast<c10::StreamId>(stream);
}
// A stream id no other stream of this process has (torch.Stream(device=...) draws from the same count).
int64_t genie_new_stream_id() { return g_next_stream.fetch_add(1); }
// Genie's Python function behind torch.accelerator.Graph (see g_graph_hook; borrowed).
void genie_set_graph_hook(PyObject* hook) {
#if GENIE_TORCH_VERSION >= 213
  g_graph_hook = hook;
#else
  (void)hook;
#endif
}
// Genie's Python function behind torch.accelerator's memory calls (see g_memory_hook).
void genie_set_memory_hook(PyObject* hook) { g_memory_hook = hook; }
// Called by Genie after (re)connecting: the number of remote devices.
void genie_set_device_count(int n) { g_device_count.store(n > 0 ? n : 1); }
// After the guard is installed: when the autograd engine started before it with no device queue
// at all (only CPU backwards ran, before `import genie`), start its device threads now, as its
// first backward would have, sized by this guard's deviceCount(). Nothing else reads the queue list
// then (no device had one), so replacing it is safe. An engine that has device queues already
// (CUDA's) is left alone: it serves remote_accelerator indices below its count.
// Returns the engine's device queues after the call, -1 when it has not started (its first backward
// will size them from this guard). Called without the GIL (ctypes releases it): the new threads take
// it to start.
int genie_start_autograd_device_threads() {
  auto& engine = torch::autograd::Engine::get_default_engine();
  if (!AutogradEngineAccess::started(engine)) return -1;
  if (AutogradEngineAccess::device_queues(engine) == 0) AutogradEngineAccess::start_threads(engine);
  return static_cast<int>(AutogradEngineAccess::device_queues(engine));
}
// Installs this guard for PrivateUse1, replacing the one-device Python guard.
void genie_install_guard() {
  // Registry entries are leaked on purpose (see DeviceGuardImplInterface.h).
  static c10::impl::DeviceGuardImplRegistrar registrar(c10::DeviceType::PrivateUse1, new RemoteGuardImpl());
  static NoStorageAllocator no_storage;
  c10::SetAllocator(c10::DeviceType::PrivateUse1, &no_storage);
#if GENIE_TORCH_VERSION >= 213
  static RemoteHostAllocator host;
  at::setHostAllocator(c10::DeviceType::PrivateUse1, &host);
  // Keyed by the backend's name (PyTorch looks it up that way): registered after the rename.
  std::string graph_key = c10::DeviceTypeName(c10::DeviceType::PrivateUse1, /*lower_case=*/false);
  if (!at::GraphImplRegistry()->Has(graph_key)) {
    at::GraphImplRegistry()->Register(graph_key, [](at::GraphImplArgs args) -> std::unique_ptr<at::GraphImplInterface> {
      return std::make_unique<RemoteGraphImpl>(args);
    });
  }
#endif
}
}
