//! IREE backend of kvsnap. Not implemented yet: see the IREE backend issue.
