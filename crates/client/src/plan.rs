//! Cutting a file range into I/O server requests.
//!
//! `Layout::chunks` gives the pieces of a range that each fall inside one stripe unit. Sending
//! one request per piece would be wasteful for a single-stripe file (every 1 MiB unit of an
//! 8 MiB write lands contiguously in the same object), so pieces that are contiguous both in
//! the file (one slice of the caller's buffer: no copy) and in the same object are merged,
//! up to a bound per request. For a file striped over several servers, consecutive units of
//! one object are not adjacent in the file, so that layout gives one request per stripe unit,
//! all of which are sent at once.

use freeflow_types::Layout;

/// One request to one stripe object: `length` bytes at `object_offset` of stripe
/// `stripe_index`, which are bytes `[file_offset, file_offset + length)` of the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ObjectRequest {
    pub stripe_index: u32,
    pub object_offset: u64,
    pub file_offset: u64,
    pub length: u64,
}

impl ObjectRequest {
    pub fn object_end(&self) -> u64 {
        self.object_offset + self.length
    }

    pub fn file_end(&self) -> u64 {
        self.file_offset + self.length
    }
}

/// The requests covering `[offset, offset + length)`, in file order, each at most
/// `request_bytes_max` long and inside one object.
pub(crate) fn plan_requests(
    layout: &Layout,
    offset: u64,
    length: u64,
    request_bytes_max: u64,
) -> Vec<ObjectRequest> {
    assert!(
        request_bytes_max > 0,
        "a request must be allowed to carry bytes"
    );
    let mut requests: Vec<ObjectRequest> = Vec::new();
    for chunk in layout.chunks(offset, length) {
        let mut chunk_done = 0;
        while chunk_done < chunk.length {
            let file_offset = chunk.file_offset + chunk_done;
            let object_offset = chunk.object_offset + chunk_done;
            let remaining = chunk.length - chunk_done;
            if let Some(last) = requests.last_mut() {
                let contiguous = last.stripe_index == chunk.stripe_index
                    && last.object_end() == object_offset
                    && last.file_end() == file_offset;
                let room = request_bytes_max - last.length;
                if contiguous && room > 0 {
                    let taken = room.min(remaining);
                    last.length += taken;
                    chunk_done += taken;
                    continue;
                }
            }
            let taken = request_bytes_max.min(remaining);
            requests.push(ObjectRequest {
                stripe_index: chunk.stripe_index,
                object_offset,
                file_offset,
                length: taken,
            });
            chunk_done += taken;
        }
    }
    requests
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn single_stripe_file_coalesces_up_to_the_request_bound() {
        let layout = Layout::new(1 << 20, vec![7]).unwrap();
        let requests = plan_requests(&layout, 0, 20 * MIB, 8 * MIB);
        let lengths: Vec<u64> = requests.iter().map(|r| r.length).collect();
        assert_eq!(lengths, vec![8 * MIB, 8 * MIB, 4 * MIB]);
        assert_eq!(requests[1].object_offset, 8 * MIB);
        assert_eq!(requests[2].file_offset, 16 * MIB);
    }

    #[test]
    fn striped_file_gives_one_request_per_unit_round_robin() {
        let layout = Layout::new(1 << 20, vec![1, 2, 3, 4]).unwrap();
        let requests = plan_requests(&layout, 0, 8 * MIB, 8 * MIB);
        let stripes: Vec<u32> = requests.iter().map(|r| r.stripe_index).collect();
        assert_eq!(stripes, vec![0, 1, 2, 3, 0, 1, 2, 3]);
        assert!(requests.iter().all(|r| r.length == MIB));
        // The second row lands one unit further into each object.
        assert_eq!(requests[4].object_offset, MIB);
        assert_eq!(requests[4].file_offset, 4 * MIB);
    }

    #[test]
    fn unaligned_range_is_cut_at_unit_boundaries() {
        let layout = Layout::new(4096, vec![1, 2]).unwrap();
        let requests = plan_requests(&layout, 4000, 5000, 8 * MIB);
        assert_eq!(
            requests,
            vec![
                ObjectRequest {
                    stripe_index: 0,
                    object_offset: 4000,
                    file_offset: 4000,
                    length: 96
                },
                ObjectRequest {
                    stripe_index: 1,
                    object_offset: 0,
                    file_offset: 4096,
                    length: 4096
                },
                ObjectRequest {
                    stripe_index: 0,
                    object_offset: 4096,
                    file_offset: 8192,
                    length: 808
                },
            ]
        );
    }

    #[test]
    fn a_unit_larger_than_the_bound_is_split() {
        let layout = Layout::new(1 << 20, vec![1, 2]).unwrap();
        let requests = plan_requests(&layout, 0, MIB + 10, 300_000);
        let lengths: Vec<u64> = requests.iter().map(|r| r.length).collect();
        assert_eq!(lengths, vec![300_000, 300_000, 300_000, MIB - 900_000, 10]);
        assert_eq!(requests[3].stripe_index, 0);
        assert_eq!(requests[4].stripe_index, 1);
    }

    #[test]
    fn empty_range_gives_no_requests() {
        let layout = Layout::new(4096, vec![1]).unwrap();
        assert!(plan_requests(&layout, 12345, 0, 8 * MIB).is_empty());
    }

    proptest! {
        #[test]
        fn requests_tile_the_range_and_respect_the_layout(
            shift in 12u32..=21,
            count in 1u32..=6,
            offset in 0u64..(1 << 30),
            length in 0u64..(1 << 25),
            bound in 1u64..(16 << 20),
        ) {
            let layout = Layout::new(1 << shift, (0..count).collect()).unwrap();
            let requests = plan_requests(&layout, offset, length, bound);
            let mut cursor = offset;
            for request in &requests {
                prop_assert_eq!(request.file_offset, cursor);
                prop_assert!(request.length > 0 && request.length <= bound);
                // Every byte of the request is where the layout says it is.
                prop_assert_eq!(layout.locate(request.file_offset), (request.stripe_index, request.object_offset));
                let last = request.file_end() - 1;
                prop_assert_eq!(layout.locate(last), (request.stripe_index, request.object_end() - 1));
                cursor = request.file_end();
            }
            prop_assert_eq!(cursor, offset + length);
            // Coalescing is maximal: no two neighbours could have been merged.
            for pair in requests.windows(2) {
                let mergeable = pair[0].stripe_index == pair[1].stripe_index
                    && pair[0].object_end() == pair[1].object_offset
                    && pair[0].length + pair[1].length <= bound;
                prop_assert!(!mergeable);
            }
        }
    }
}
