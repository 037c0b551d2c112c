//! The kernel NBD backend in a real kernel: QEMU (TCG) boots Debian's kernel, whose nbd.ko
//! this host lacks, with a busybox initramfs; the guest mounts the host's root read-only over
//! 9p, chroots into it and runs this build's `strata` daemon, which attaches the guest
//! kernel's NBD client over netlink (`tests/guest/nbd.sh` says what is checked). Two boots
//! on one data disk: the second after QEMU was killed (the guest's power cut).
//!
//! The kit (kernel and modules, extracted from Debian's `linux-image-*-amd64` package with a
//! `modules.dep` made by `busybox depmod`) comes from `.ci/guest-kit.sh`; `STRATA_GUEST_KIT`
//! points at it (default `/var/cache/strata-guest`). Without it, or without QEMU, the test
//! says SKIPPED, and fails under `STRATA_REQUIRE_GUEST=1` (CI).

#[path = "guest/kit.rs"]
mod kit;

use std::process::Command;
use std::time::{Duration, Instant};

use kit::{initramfs, ready, reuse, Guest};

#[test]
fn kernel_nbd_mount_survives_daemon_restart_and_power_cut_in_a_real_guest() {
    let Some(kit) = ready("kernel NBD guest test") else {
        return;
    };
    let (root, work, _keep) = kit::workdir();
    std::fs::copy(env!("CARGO_BIN_EXE_strata"), work.join("strata")).unwrap();
    std::fs::write(work.join("nbd.sh"), include_str!("guest/nbd.sh")).unwrap();
    let disk = root.as_path().join("data.img");
    let f = std::fs::File::create(&disk).unwrap();
    f.set_len(2 << 30).unwrap();
    drop(f);
    let ok = Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&disk)
        .status()
        .unwrap()
        .success();
    assert!(ok, "mkfs.ext4 of the guest's data disk");
    let modules = [
        "virtio_pci",
        "virtio_blk",
        "9pnet_virtio",
        "9p",
        "nbd",
        "ext4",
        "crc32c_generic",
    ];
    let initrd = initramfs(&kit, root.as_path(), &modules, "nbd.sh");
    let drive = vec![
        "-drive".to_string(),
        format!(
            "file={},format=raw,if=virtio,cache=writeback",
            disk.display()
        ),
    ];
    let started = Instant::now();

    let mut g = Guest::boot(&kit, &initrd, &work, &drive, 1);
    g.expect("STEP mounted", Duration::from_secs(240));
    g.expect("STEP 8 files", Duration::from_secs(120));
    g.expect("STEP daemon killed", Duration::from_secs(120));
    g.expect("STEP fio verify passed", Duration::from_secs(400));
    g.expect("STEP daemon stopped cleanly", Duration::from_secs(120));
    g.expect("STEP clean restart", Duration::from_secs(300));
    g.expect("STEP umount, mount", Duration::from_secs(180));
    g.expect("STEP grown to 512 MiB", Duration::from_secs(300));
    g.expect("STEP checkpoint and live fork", Duration::from_secs(240));
    g.expect(
        "STEP devices reused",
        Duration::from_secs(60 + 20 * reuse() as u64),
    );
    g.expect("STEP KILL-ME", Duration::from_secs(180));
    // The guest's power cut: nothing it had not fsync'd is owed.
    g.child.kill().unwrap();
    let _ = g.child.wait();
    drop(g);
    eprintln!("guest phase 1 done in {:?}; QEMU killed", started.elapsed());

    let mut g = Guest::boot(&kit, &initrd, &work, &drive, 2);
    g.expect("STEP remounted", Duration::from_secs(300));
    g.expect("STEP every fsync'd file intact", Duration::from_secs(120));
    g.expect("STEP e2fsck -fn clean", Duration::from_secs(300));
    g.expect("STEP DONE 2", Duration::from_secs(60));
    eprintln!("guest test done in {:?}", started.elapsed());
}
