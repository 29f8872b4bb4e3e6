//! The virtio-blk device configuration space and feature bits we offer.

use vhost::vhost_user::message::VhostUserVirtioFeatures;
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

/// Largest bytes in one data segment (advertised as SIZE_MAX).
pub const SIZE_MAX: u32 = 1 << 20;
/// Largest number of data segments in one request (advertised as SEG_MAX).
pub const SEG_MAX: u32 = 126;
/// Largest sectors in one discard/write-zeroes segment.
pub const MAX_DISCARD_SECTORS: u32 = (1 << 22) - 1;
/// Largest segments in one discard/write-zeroes request.
pub const MAX_DISCARD_SEG: u32 = 32;
/// Logical block size advertised to the guest.
pub const BLK_SIZE: u32 = 512;

/// Virtio feature bits offered for a volume.
pub fn features(read_only: bool, encrypted: bool) -> u64 {
    let mut f = (1u64 << VIRTIO_F_VERSION_1)
        | VHOST_F_LOG_ALL
        | (1 << VIRTIO_RING_F_EVENT_IDX)
        | (1 << VIRTIO_RING_F_INDIRECT_DESC)
        | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
        | (1 << VIRTIO_BLK_F_SIZE_MAX)
        | (1 << VIRTIO_BLK_F_SEG_MAX)
        | (1 << VIRTIO_BLK_F_BLK_SIZE)
        | (1 << VIRTIO_BLK_F_FLUSH)
        | (1 << VIRTIO_BLK_F_MQ);
    if read_only {
        f |= 1 << VIRTIO_BLK_F_RO;
    } else {
        f |= 1 << VIRTIO_BLK_F_DISCARD;
        // Zeroes on the device would decrypt to noise: an encrypted volume's guest writes
        // zeroes as data (its kernel falls back to that), as on dm-crypt.
        if !encrypted {
            f |= 1 << VIRTIO_BLK_F_WRITE_ZEROES;
        }
    }
    f
}

/// `VHOST_F_LOG_ALL`: the frontend may turn on dirty-page logging (live migration,
/// `crate::dirty_log`); QEMU refuses to migrate a VM whose backend does not offer it.
pub const VHOST_F_LOG_ALL: u64 = 1 << 26;

/// Size of the config space we serve (the virtio 1.2 layout up to the secure-erase fields;
/// reads beyond it return zeroes).
pub const CONFIG_LEN: usize = 72;

/// Encodes `struct virtio_blk_config` (little-endian, virtio 1.2 §5.2.4); discards are
/// advertised aligned to `discard_alignment` bytes (a thin volume's chunk).
pub fn config_space(
    capacity_bytes: u64,
    num_queues: u16,
    discard_alignment: u64,
) -> [u8; CONFIG_LEN] {
    let mut c = [0u8; CONFIG_LEN];
    let put32 = |c: &mut [u8; CONFIG_LEN], at: usize, v: u32| {
        c[at..at + 4].copy_from_slice(&v.to_le_bytes())
    };
    c[0..8].copy_from_slice(&(capacity_bytes / 512).to_le_bytes());
    put32(&mut c, 8, SIZE_MAX);
    put32(&mut c, 12, SEG_MAX);
    // 16..20 geometry: unused
    put32(&mut c, 20, BLK_SIZE);
    // 24..32 topology: unused (not offered)
    c[32] = 0; // writeback (CONFIG_WCE not offered)
    c[34..36].copy_from_slice(&num_queues.to_le_bytes());
    put32(&mut c, 36, MAX_DISCARD_SECTORS);
    put32(&mut c, 40, MAX_DISCARD_SEG);
    let align = (discard_alignment / 512).clamp(8, MAX_DISCARD_SECTORS as u64);
    put32(&mut c, 44, align as u32); // discard_sector_alignment
    put32(&mut c, 48, MAX_DISCARD_SECTORS);
    put32(&mut c, 52, MAX_DISCARD_SEG);
    c[56] = 1; // write_zeroes_may_unmap
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_layout() {
        let c = config_space(1 << 30, 4, 4096);
        assert_eq!(u32::from_le_bytes(c[44..48].try_into().unwrap()), 8);
        let thin = config_space(1 << 30, 4, 4 << 20);
        assert_eq!(u32::from_le_bytes(thin[44..48].try_into().unwrap()), 8192);
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), 1 << 21);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 4);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 512);
        assert_eq!(
            features(true, false) & (1 << VIRTIO_BLK_F_RO),
            1 << VIRTIO_BLK_F_RO
        );
        assert_eq!(features(true, false) & (1 << VIRTIO_BLK_F_DISCARD), 0);
        let zeroes = 1 << VIRTIO_BLK_F_WRITE_ZEROES;
        assert_eq!(features(false, false) & zeroes, zeroes);
        assert_eq!(
            features(false, true) & zeroes,
            0,
            "encrypted: no write-zeroes"
        );
        assert_ne!(features(false, true) & (1 << VIRTIO_BLK_F_DISCARD), 0);
    }
}
