#![no_main]
//! A virtio-blk request chain from a hostile guest: the descriptor table, the avail ring and
//! every buffer come from the input; the chain is parsed and run against an in-memory disk.
//! Nothing may panic, and no access may leave guest memory (AddressSanitizer watches
//! `vm-memory`'s unsafe copies).
use libfuzzer_sys::fuzz_target;
use strata_nbd::MemDevice;
use strata_vhost::{blk, Features};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const MEM: usize = 0x10000;

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM)]).unwrap();
    let n = data.len().min(MEM);
    mem.write_slice(&data[..n], GuestAddress(0)).unwrap();
    // The queue: size from the input (a power of two up to 256), table at 0, rings after it.
    let size = 1u16 << (data[0] % 9);
    let mut q = Queue::new(256).unwrap();
    q.set_size(size);
    if q.try_set_desc_table_address(GuestAddress(0)).is_err()
        || q.try_set_avail_ring_address(GuestAddress(0x1000)).is_err()
        || q.try_set_used_ring_address(GuestAddress(0x2000)).is_err()
    {
        return;
    }
    q.set_ready(true);
    let features = Features {
        read_only: data[1] & 1 == 1,
        flush: data[1] & 2 == 2,
        num_queues: 1,
        queue_size: size,
        serial: "fuzz".into(),
        unsealed_memory: false,
    };
    let dev = MemDevice::new(1 << 20);
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    // A few chains, as a batch would take them.
    let Ok(iter) = q.iter(&mem) else { return };
    for chain in iter.take(4) {
        if let Ok(req) = blk::parse_chain(&mem, chain, 1 << 20, &features) {
            let used = rt.block_on(req.run(&*dev, data[2] & 1 == 1));
            assert!(used as usize <= blk::MAX_REQUEST_BYTES + 1);
        }
    }
});
