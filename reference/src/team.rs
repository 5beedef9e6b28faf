//! The threads a forward pass's kernels run on: the calling thread and one worker per other
//! core, which spin between kernels instead of sleeping.
//!
//! A decode step runs some 160 parallel kernels, microseconds apart. On rayon's pool an idle
//! worker yields 32 times, then sleeps on a futex, and the next kernel waits for it to wake:
//! on a 2-vCPU KVM host a decode step woke the other worker about 68 times. Here a worker
//! spins on the job word (a `pause` loop) for up to [`SPIN`] after its last task, then parks:
//! a pass's kernels find it running (about 3 wake-ups a step), and between passes it costs
//! nothing. On that host the catalog's decode step went from 23.3-24.5 to 22.2-22.6 ms and its
//! turn from 402-421 to 380-390 ms (docs/BENCHMARKS.md, twenty-seventh pass).
//!
//! [`for_each`] runs tasks `0..n`: the caller publishes the job, claims tasks beside the
//! workers, and returns once every task has finished. Called from a thread of a rayon pool (a
//! caller that chose its pool, as the tests that vary the thread count do), while another
//! thread's job holds the team, or where the workers could not be started, the tasks go to
//! rayon instead; called from inside a task, they run on the calling thread.
//!
//! The job word packs a generation (32 bits), the task count and the next unclaimed task (16
//! bits each). A task is claimed by a compare-and-swap on the whole word, so a claim succeeds
//! only for the job it was read from; the job's closure, on its caller's stack, is read only
//! after such a claim, while its caller is still waiting for that task.

use std::any::Any;
use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// How long a worker spins for the next job before it parks: longer than most gaps between a
/// pass's kernels, short enough that the spinning after a pass is a small share of it (a
/// decode step takes some 22 ms).
pub const SPIN: Duration = Duration::from_micros(300);

/// Most tasks the job word holds; [`for_each`] groups more into this many.
const MAX_TASKS: usize = u16::MAX as usize;

/// A job's tasks, as its caller holds them.
type Job<'a> = &'a (dyn Fn(usize) + Sync);

thread_local! {
    /// Whether this thread is running a task of a team job (nested calls run in place).
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

/// The calling thread and its spinning workers (one process-wide team, [`team`]).
struct Team {
    /// `generation << 32 | tasks << 16 | next`: the current job, and its next unclaimed task.
    word: AtomicU64,
    /// The current job's [`Job`], on its caller's stack: read only after a claim on the job
    /// word succeeded.
    job: AtomicPtr<Job<'static>>,
    /// Tasks of the current job that have finished.
    done: AtomicUsize,
    /// The first panic of the current job's tasks, resumed on its caller once all finished.
    panic: FirstPanic,
    /// Set while a caller's job runs: a second caller goes to rayon instead of waiting.
    busy: AtomicBool,
    /// Workers parked (or about to), so that a new job knows to wake them.
    parked: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
}

/// The job word's fields.
fn fields(word: u64) -> (u32, usize, usize) {
    (
        (word >> 32) as u32,
        (word >> 16) as u16 as usize,
        word as u16 as usize,
    )
}

impl Team {
    /// Claims and runs the tasks of the job `generation` until none is left unclaimed.
    fn work(&self, generation: u32) {
        let mut word = self.word.load(Ordering::Acquire);
        loop {
            let (current, tasks, next) = fields(word);
            if current != generation || next >= tasks {
                return;
            }
            match self.word.compare_exchange_weak(
                word,
                word + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    // SAFETY: task `next` of this job is claimed and unfinished, so its caller
                    // is still in `for_each`, and `job` points to its closure.
                    let job = unsafe { *self.job.load(Ordering::Acquire) };
                    self.run(job, next);
                    self.done.fetch_add(1, Ordering::Release);
                    word = self.word.load(Ordering::Acquire);
                }
                Err(now) => word = now,
            }
        }
    }

    /// Runs one task, keeping its panic (the first of the job's) for the caller.
    fn run(&self, job: Job, task: usize) {
        IN_TASK.with(|t| t.set(true));
        self.panic.run(job, task);
        IN_TASK.with(|t| t.set(false));
    }

    /// A worker: runs each new job's tasks, spins for the next one, parks after [`SPIN`].
    fn serve(&self) {
        let mut idle_since: Option<Instant> = None;
        let mut spins = 0u32;
        loop {
            let word = self.word.load(Ordering::Acquire);
            let (generation, tasks, next) = fields(word);
            if next < tasks {
                self.work(generation);
                idle_since = None;
                continue;
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) {
                continue;
            }
            let now = Instant::now();
            match idle_since {
                None => idle_since = Some(now),
                Some(since) if now - since >= SPIN => {
                    self.sleep_while(word);
                    idle_since = None;
                }
                Some(_) => {}
            }
        }
    }

    /// Parks until a job is published, unless one was since `word` was read.
    fn sleep_while(&self, word: u64) {
        let guard = self.park.lock().unwrap_or_else(PoisonError::into_inner);
        // Announced before the word is read again, as `publish` stores the word before it
        // reads this (both sequentially consistent): either the new word is seen here or the
        // publisher sees a parked worker and takes the lock to wake it.
        self.parked.fetch_add(1, Ordering::SeqCst);
        if self.word.load(Ordering::SeqCst) == word {
            drop(
                self.wake
                    .wait(guard)
                    .unwrap_or_else(PoisonError::into_inner),
            );
        }
        self.parked.fetch_sub(1, Ordering::SeqCst);
    }

    /// Publishes `tasks` tasks of `job`, runs them beside the workers, and returns when all
    /// have finished (resuming the first task's panic, if any).
    fn join(&self, tasks: usize, job: Job) {
        let generation = fields(self.word.load(Ordering::Relaxed)).0.wrapping_add(1);
        self.job
            .store((&job as *const Job).cast_mut().cast(), Ordering::Relaxed);
        self.done.store(0, Ordering::Relaxed);
        self.word.store(
            (generation as u64) << 32 | (tasks as u64) << 16,
            Ordering::SeqCst,
        );
        if self.parked.load(Ordering::SeqCst) > 0 {
            let _guard = self.park.lock().unwrap_or_else(PoisonError::into_inner);
            self.wake.notify_all();
        }
        self.work(generation);
        // The workers' last tasks: short, unless a worker was preempted (then yield to it).
        let mut spins = 0u32;
        while self.done.load(Ordering::Acquire) < tasks {
            spins = spins.saturating_add(1);
            if spins < 1 << 16 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let payload = self.panic.take();
        self.busy.store(false, Ordering::Release);
        if let Some(payload) = payload {
            panic::resume_unwind(payload);
        }
    }
}

/// The process's team: one worker per core of rayon's global pool but the caller's, started
/// on first use; `None` on one core or where a worker thread could not be started.
fn team() -> Option<&'static Team> {
    static TEAM: OnceLock<Option<&'static Team>> = OnceLock::new();
    *TEAM.get_or_init(|| {
        let workers = rayon::current_num_threads().saturating_sub(1);
        if workers == 0 {
            return None;
        }
        let team: &'static Team = Box::leak(Box::new(Team {
            word: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicUsize::new(0),
            panic: FirstPanic::default(),
            // Busy until every worker has started: a partial team is never used.
            busy: AtomicBool::new(true),
            parked: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
        }));
        for w in 0..workers {
            std::thread::Builder::new()
                .name(format!("kvsnap-team-{w}"))
                .spawn(move || team.serve())
                .ok()?;
        }
        team.busy.store(false, Ordering::Release);
        Some(team)
    })
}

/// Runs `f(t)` for every `t` in `0..tasks`, in parallel, returning when all have run: on the
/// calling thread and the team's spinning workers, or on rayon's pool (see the module
/// documentation for when). A task's panic is resumed here once every task has finished.
pub fn for_each(tasks: usize, f: impl Fn(usize) + Sync) {
    dispatch(tasks, &f);
}

/// [`for_each`] for one closure type.
fn dispatch(tasks: usize, f: Job) {
    match tasks {
        0 => return,
        1 => return f(0),
        _ => {}
    }
    if IN_TASK.with(Cell::get) {
        let first = FirstPanic::default();
        (0..tasks).for_each(|t| first.run(f, t));
        return first.resume();
    }
    if tasks > MAX_TASKS {
        let per = tasks.div_ceil(MAX_TASKS);
        return dispatch(tasks.div_ceil(per), &|g| {
            (g * per..(g * per + per).min(tasks)).for_each(f)
        });
    }
    // Only off rayon's threads: the team is sized (on first use) by the global pool.
    let team = rayon::current_thread_index()
        .is_none()
        .then(team)
        .flatten()
        .filter(|team| {
            team.busy
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        });
    match team {
        Some(team) => team.join(tasks, f),
        None => {
            let first = FirstPanic::default();
            (0..tasks).into_par_iter().for_each(|t| first.run(f, t));
            first.resume();
        }
    }
}

/// The first panic of a job's tasks, kept until every task has run and then resumed on the
/// caller: on the team ([`Team::join`]) and off it, where uncaught, a task's panic would skip
/// the tasks after it in its thread's share (rayon's, or the caller's own loop).
#[derive(Default)]
struct FirstPanic(Mutex<Option<Box<dyn Any + Send>>>);

impl FirstPanic {
    /// Runs task `t`, keeping its panic if it is the first.
    fn run(&self, f: Job, t: usize) {
        if let Err(payload) = panic::catch_unwind(AssertUnwindSafe(|| f(t))) {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_or_insert(payload);
        }
    }

    /// The first panic kept, if a task panicked; none is kept afterwards.
    fn take(&self) -> Option<Box<dyn Any + Send>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// Resumes the first panic, if a task panicked.
    fn resume(&self) {
        if let Some(payload) = self.take() {
            panic::resume_unwind(payload);
        }
    }
}

/// `data` in chunks of `size` (the last may be shorter), `f(index, chunk)` run for each as
/// [`for_each`] runs its tasks.
pub fn for_each_chunk<T: Send>(data: &mut [T], size: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let size = size.max(1);
    let len = data.len();
    let base = Base(data.as_mut_ptr());
    for_each(len.div_ceil(size), |c| {
        let start = c * size;
        let end = (start + size).min(len);
        // SAFETY: chunk `c` is `data[start..end]`, within `data`, and only task `c` touches it;
        // `data` is borrowed mutably until every task has finished.
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.at(start), end - start) };
        f(c, chunk)
    });
}

/// `out` in chunks of `size` beside `input` in chunks of `input_size` (the last of either may
/// be shorter), `f(out_chunk, input_chunk)` run for each pair as [`for_each`] runs its tasks:
/// pairs while both sides have a chunk, as rayon's `par_chunks_mut(..).zip(par_chunks(..))`.
pub fn for_each_chunk_zip<T: Send, U: Sync>(
    out: &mut [T],
    size: usize,
    input: &[U],
    input_size: usize,
    f: impl Fn(&mut [T], &[U]) + Sync,
) {
    let input_size = input_size.max(1);
    for_each_chunk(out, size, |c, chunk| {
        let start = c * input_size;
        if start < input.len() {
            f(chunk, &input[start..(start + input_size).min(input.len())]);
        }
    });
}

/// `[f(0), .., f(tasks - 1)]`, the calls run as [`for_each`] runs its tasks.
pub fn map<T: Send>(tasks: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let mut out: Vec<Option<T>> = (0..tasks).map(|_| None).collect();
    for_each_chunk(&mut out, 1, |t, slot| slot[0] = Some(f(t)));
    // `for_each_chunk` returns only once every task has run (or resumes a task's panic).
    out.into_iter()
        .map(|v| v.expect("every task has run"))
        .collect()
}

/// `0..len` cut into `parts` contiguous ranges (lengths differing by at most one, none empty
/// unless `len < parts`): range `p`.
pub fn part(len: usize, parts: usize, p: usize) -> std::ops::Range<usize> {
    len * p / parts..len * (p + 1) / parts
}

/// Tasks to cut a kernel into: `per_thread` for each thread a job runs on (a few, so that
/// dynamic claiming evens out threads that start late).
pub fn tasks(per_thread: usize) -> usize {
    per_thread * rayon::current_num_threads()
}

/// The base of a slice whose disjoint chunks the tasks write.
struct Base<T>(*mut T);
// SAFETY: each task reaches only its own chunk (see `for_each_chunk`), and `T: Send`.
unsafe impl<T: Send> Sync for Base<T> {}

impl<T> Base<T> {
    /// Element `i` (a method, so that a closure captures the `Sync` wrapper, not the field).
    fn at(&self, i: usize) -> *mut T {
        self.0.wrapping_add(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_once() {
        for tasks in [0, 1, 2, 3, 17, 1000] {
            let hits: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
            for_each(tasks, |t| {
                hits[t].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "{tasks} tasks"
            );
        }
    }

    #[test]
    fn more_tasks_than_the_word_holds_are_grouped() {
        let tasks = MAX_TASKS * 2 + 5;
        let hits: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
        for_each(tasks, |t| {
            hits[t].fetch_add(1, Ordering::Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn chunks_cover_the_slice_once() {
        let mut data = vec![0u32; 1003];
        for_each_chunk(&mut data, 64, |c, chunk| {
            assert!(chunk.len() == 64 || c == 1003 / 64, "chunk {c}");
            chunk.iter_mut().for_each(|x| *x += c as u32 + 1);
        });
        for (i, x) in data.iter().enumerate() {
            assert_eq!(*x, (i / 64) as u32 + 1, "element {i}");
        }
    }

    #[test]
    fn zipped_chunks_pair_up_while_both_sides_have_one() {
        // 10 chunks of 3 outputs beside 10 of 2 inputs (the last of each shorter).
        let input: Vec<u32> = (0..19).collect();
        let mut out = vec![0u32; 29];
        for_each_chunk_zip(&mut out, 3, &input, 2, |o, i| {
            assert!(o.len() == 3 || o.len() == 2, "{}", o.len());
            o.fill(i.iter().sum::<u32>() + 1);
        });
        for (k, x) in out.iter().enumerate() {
            let c = k / 3;
            let want = input[2 * c..(2 * c + 2).min(19)].iter().sum::<u32>() + 1;
            assert_eq!(*x, want, "output {k}");
        }
        // More output chunks than input ones: the unpaired ones are not touched.
        let mut out = vec![0u32; 12];
        for_each_chunk_zip(&mut out, 3, &input[..4], 2, |o, _| o.fill(7));
        assert_eq!(out, [7, 7, 7, 7, 7, 7, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn map_keeps_the_order_and_parts_tile_the_range() {
        assert_eq!(
            map(50, |t| t * t),
            (0..50).map(|t| t * t).collect::<Vec<_>>()
        );
        for (len, parts) in [(0, 3), (2, 4), (20, 4), (21, 4), (128, 8)] {
            let ranges: Vec<_> = (0..parts).map(|p| part(len, parts, p)).collect();
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[parts - 1].end, len);
            assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
            let (min, max) = ranges.iter().fold((usize::MAX, 0), |(a, b), r| {
                (a.min(r.len()), b.max(r.len()))
            });
            assert!(max - min <= 1, "{len} in {parts}: {ranges:?}");
        }
    }

    #[test]
    fn nested_calls_run_in_place() {
        let sum = AtomicU32::new(0);
        for_each(4, |_| {
            for_each(8, |t| {
                sum.fetch_add(t as u32, Ordering::Relaxed);
            })
        });
        assert_eq!(sum.load(Ordering::Relaxed), 4 * 28);
    }

    #[test]
    fn concurrent_callers_each_get_all_their_tasks() {
        // Two threads' jobs at once: one holds the team, the other goes to rayon; either way
        // each caller's tasks all run before it returns.
        std::thread::scope(|s| {
            for caller in 0..2u32 {
                s.spawn(move || {
                    for round in 0..200u32 {
                        let sum = AtomicU32::new(0);
                        for_each(16, |t| {
                            sum.fetch_add(t as u32 + caller + round, Ordering::Relaxed);
                        });
                        assert_eq!(sum.load(Ordering::Relaxed), 120 + 16 * (caller + round));
                    }
                });
            }
        });
    }

    /// 64 tasks, task 40 panicking, run by `for_each` where `run` calls it: the panic reaches
    /// the caller, after all 64 ran.
    fn panic_after_every_task(run: impl FnOnce(&(dyn Fn() + Sync))) {
        let ran = AtomicU32::new(0);
        let result = panic::catch_unwind(AssertUnwindSafe(|| {
            run(&|| {
                for_each(64, |t| {
                    ran.fetch_add(1, Ordering::Relaxed);
                    assert_ne!(t, 40, "task 40 fails");
                })
            })
        }));
        let message = result.expect_err("the panic is resumed");
        let text = message
            .downcast_ref::<String>()
            .map(String::as_str)
            .unwrap_or_default();
        assert!(text.contains("task 40 fails"), "{text}");
        assert_eq!(ran.load(Ordering::Relaxed), 64);
    }

    /// On a rayon thread the tasks go to rayon's pool (as they do while another caller holds
    /// the team), and within a task they run in the caller's loop: a panic skips no task
    /// either way.
    #[test]
    fn a_task_panic_off_the_team_reaches_the_caller_after_every_task_ran() {
        panic_after_every_task(|job| rayon::scope(|_| job()));
        panic_after_every_task(|job| {
            for_each(2, |t| {
                if t == 0 {
                    job()
                }
            })
        });
    }

    #[test]
    fn a_task_panic_reaches_the_caller_after_every_task_ran() {
        panic_after_every_task(|job| job());
        // The team is free again.
        let sum = AtomicU32::new(0);
        for_each(8, |t| {
            sum.fetch_add(t as u32, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 28);
    }

    #[test]
    fn a_parked_worker_wakes_for_the_next_job() {
        let threads = rayon::current_num_threads();
        if threads < 2 {
            eprintln!("SKIPPED a_parked_worker_wakes_for_the_next_job: one thread, no workers");
            return;
        }
        for_each(threads, |_| {});
        std::thread::sleep(SPIN * 4);
        // Every task waits for all of them to have started: they finish in time only if they
        // run at once, so only if the parked worker woke and took its share.
        let (started, late) = (AtomicUsize::new(0), AtomicBool::new(false));
        for_each(threads, |_| {
            started.fetch_add(1, Ordering::AcqRel);
            let start = Instant::now();
            while started.load(Ordering::Acquire) < threads {
                if start.elapsed() > Duration::from_secs(2) {
                    late.store(true, Ordering::Relaxed);
                    return;
                }
                std::hint::spin_loop();
            }
        });
        assert!(
            !late.load(Ordering::Relaxed),
            "a task waited 2 s for the others"
        );
    }
}
