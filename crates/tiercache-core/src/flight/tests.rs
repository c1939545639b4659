//! The single flight's own rules, on a paused clock where time matters.

use super::*;
use crate::{CacheKey, Times, Value};
use std::time::SystemTime;

const WAIT: Duration = Duration::from_secs(5);

fn entry() -> Entry {
    let now = SystemTime::now();
    Entry::new(
        "k".into(),
        Default::default(),
        Value::from_body("v"),
        Times::fresh(now, now),
        Duration::ZERO,
    )
}

fn join(flights: &Arc<Flights>) -> Join {
    flights.join(CacheKey::new("k").hash(), WAIT)
}

#[tokio::test]
async fn followers_get_the_leaders_result() {
    let flights = Arc::new(Flights::default());
    let Join::Leader(leader) = join(&flights) else {
        panic!("first is leader")
    };
    let followers: Vec<_> = (0..10)
        .map(|_| match join(&flights) {
            Join::Follower(f) => tokio::spawn(f.wait()),
            Join::Leader(_) => panic!("second leader"),
        })
        .collect();
    assert_eq!(leader.waiters(), 10);
    leader.complete(FlightResult::Shared(entry(), Source::Origin));
    for f in followers {
        assert!(matches!(
            f.await.unwrap(),
            Waited::Done(FlightResult::Shared(_, Source::Origin))
        ));
    }
    assert_eq!(flights.in_flight(), 0);
    assert!(matches!(join(&flights), Join::Leader(_)));
}

#[tokio::test]
async fn a_panicking_leader_wakes_followers_with_an_error() {
    let flights = Arc::new(Flights::default());
    let Join::Leader(leader) = join(&flights) else {
        panic!()
    };
    let Join::Follower(follower) = join(&flights) else {
        panic!()
    };
    let task = tokio::spawn(async move {
        let _leader = leader;
        panic!("origin exploded");
    });
    assert!(task.await.unwrap_err().is_panic());
    assert!(matches!(
        follower.wait().await,
        Waited::Done(FlightResult::Failed(FlightError::Panicked))
    ));
    assert_eq!(flights.in_flight(), 0);
}

#[tokio::test]
async fn a_dropped_leader_abandons() {
    let flights = Arc::new(Flights::default());
    let Join::Leader(leader) = join(&flights) else {
        panic!()
    };
    let Join::Follower(follower) = join(&flights) else {
        panic!()
    };
    drop(leader);
    assert!(matches!(
        follower.wait().await,
        Waited::Done(FlightResult::Failed(FlightError::Abandoned))
    ));
}

#[test]
fn past_the_cap_leaders_load_alone() {
    let flights = Arc::new(Flights::with_cap(2));
    let leaders: Vec<_> = (0..5u32)
        .map(|i| flights.join(CacheKey::new(i.to_le_bytes()).hash(), WAIT))
        .collect();
    assert!(leaders.iter().all(|j| matches!(j, Join::Leader(_))));
    assert_eq!(flights.in_flight(), 2, "the map stays bounded");
    drop(leaders);
    assert_eq!(flights.in_flight(), 0);
}

/// The deadline counts from the flight's start: a follower that arrives
/// late waits only for what is left of it.
#[tokio::test(start_paused = true)]
async fn the_deadline_counts_from_the_flights_start() {
    let flights = Arc::new(Flights::default());
    let wait = Duration::from_millis(100);
    let key = CacheKey::new("k").hash();
    let Join::Leader(_leader) = flights.join(key, wait) else {
        panic!()
    };
    tokio::time::sleep(Duration::from_millis(80)).await;
    let Join::Follower(late) = flights.join(key, wait) else {
        panic!()
    };
    let started = Instant::now();
    assert!(matches!(late.wait().await, Waited::TimedOut));
    assert_eq!(started.elapsed(), Duration::from_millis(20));
}

/// Past the deadline the next request takes the flight over, and the
/// ones after it follow the new leader (one at a time, not all at once).
#[tokio::test(start_paused = true)]
async fn a_stalled_leader_is_taken_over_by_one_request() {
    let flights = Arc::new(Flights::default());
    let wait = Duration::from_millis(100);
    let key = CacheKey::new("k").hash();
    let Join::Leader(stalled) = flights.join(key, wait) else {
        panic!()
    };
    tokio::time::sleep(wait).await;
    let Join::Leader(new) = flights.join(key, wait) else {
        panic!("the stalled flight is taken over")
    };
    assert!(matches!(flights.join(key, wait), Join::Follower(_)));
    // The stalled leader finishing late does not end the new flight.
    stalled.complete(FlightResult::Released);
    assert_eq!(flights.in_flight(), 1);
    new.complete(FlightResult::Released);
    assert_eq!(flights.in_flight(), 0);
}

/// A flight on `key` whose leader is slow, taken over at its deadline:
/// the slow leader, the new one, and a follower of the new flight.
async fn taken_over(
    flights: &Arc<Flights>,
    key: KeyHash,
    wait: Duration,
) -> (Leader, Leader, Follower) {
    let Join::Leader(slow) = flights.join(key, wait) else {
        panic!("no flight yet")
    };
    tokio::time::sleep(wait).await;
    let Join::Leader(new) = flights.join(key, wait) else {
        panic!("the slow flight is taken over at its deadline")
    };
    let Join::Follower(waiting) = flights.join(key, wait) else {
        panic!("the next request follows the new leader")
    };
    (slow, new, waiting)
}

/// A slow leader's stored answer reaches the followers of the flight
/// that took it over, and whoever joins that flight later; one that may
/// not be shared releases the followers waiting then (to load alone),
/// not later ones; an abandoned load reaches none.
#[tokio::test(start_paused = true)]
async fn a_slow_leaders_shared_answer_reaches_the_newer_flight() {
    let flights = Arc::new(Flights::default());
    let wait = Duration::from_millis(100);
    let key = CacheKey::new("k").hash();
    let (slow, new, waiting) = taken_over(&flights, key, wait).await;
    slow.complete(FlightResult::Shared(entry(), Source::Origin));
    assert!(matches!(
        waiting.wait().await,
        Waited::Done(FlightResult::Shared(..))
    ));
    let Join::Follower(later) = flights.join(key, wait) else {
        panic!("the newer flight is still its leader's")
    };
    assert!(matches!(
        later.wait().await,
        Waited::Done(FlightResult::Shared(..))
    ));
    new.complete(FlightResult::Released);
    assert_eq!(flights.in_flight(), 0);

    // Released (not shareable): the newer flight's followers go alone.
    let (slow, new, waiting) = taken_over(&flights, key, wait).await;
    slow.complete(FlightResult::Released);
    assert!(matches!(
        waiting.wait().await,
        Waited::Done(FlightResult::Released)
    ));
    // One that joins later waits on the newer flight's own answer.
    let Join::Follower(later) = flights.join(key, wait) else {
        panic!("the newer flight is still its leader's")
    };
    new.complete(FlightResult::Shared(entry(), Source::Origin));
    assert!(matches!(
        later.wait().await,
        Waited::Done(FlightResult::Shared(..))
    ));

    // Abandoned (its task cancelled): the newer flight's followers
    // wait on its own leader.
    let (slow, _new, waiting) = taken_over(&flights, key, wait).await;
    drop(slow);
    assert!(matches!(waiting.wait().await, Waited::TimedOut));
}
