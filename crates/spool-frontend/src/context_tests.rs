//! The volume context's layouts: one made before the one in use and published late is
//! dropped, and whether a layout older than a generation may still be held.

use spool_pool::VolumeLayout;
use uuid::Uuid;

use crate::{FrontendSettings, VolumeContext};

fn layout(generation: u64, num_queues: u16) -> VolumeLayout {
    VolumeLayout {
        uuid: Uuid::nil(),
        name: "v".into(),
        size: 1 << 20,
        read_only: false,
        num_queues,
        segments: Vec::new(),
        devices: Vec::new(),
        qos: None,
        cipher: None,
        discard_alignment: 4096,
        generation,
    }
}

#[test]
fn a_layout_published_late_is_dropped_and_old_ones_are_tracked_while_held() {
    let ctx = VolumeContext::new(layout(3, 1), FrontendSettings::default());
    assert!(ctx.holds_layout_older_than(4), "the one in use is older");
    assert!(!ctx.holds_layout_older_than(3));
    // A queue holds the generation-3 layout while a newer one is published.
    let held = ctx.layout().load_full();
    ctx.update_layout(layout(5, 2));
    assert_eq!(ctx.num_queues(), 2);
    assert!(
        ctx.holds_layout_older_than(5),
        "a queue still holds generation 3"
    );
    drop(held);
    assert!(!ctx.holds_layout_older_than(5));
    // Made before generation 5's and published after it: dropped.
    ctx.update_layout(layout(4, 7));
    assert_eq!(ctx.num_queues(), 2);
    assert_eq!(ctx.layout().load().generation, 5);
    // The same generation again (a reconnected device, no commit): taken.
    ctx.update_layout(layout(5, 3));
    assert_eq!(ctx.num_queues(), 3);
}
