// The Device operator of operator/examples/devices.py, written with controller-runtime.
//
// It is the baseline that the benchmarks compare kopf-reconcile with: the same
// validation of spec.desired, the same PostgreSQL statement (the fenced upsert of
// kopf_reconcile.fencing.postgres, at epoch 0: controller-runtime has no leader
// epoch to send) and the same status patch (a JSON patch adding /status), with
// leader election on a Lease at controller-runtime's defaults unless the flags
// say otherwise, and its metrics served.
//
// Settings: KUBECONFIG (the cluster), KOPF_RECONCILE_DATABASE_URL (PostgreSQL),
// DEVICES_WORK_DELAY (seconds of simulated device I/O before each write, as the
// example's), and the flags below. With --events it prints one JSON line on
// stdout when it starts leading and at its first reconcile as leader, stamped
// with CLOCK_MONOTONIC, the clock of Python's time.monotonic() and one clock for
// every process of the machine ({"event": "leader", "t": 1234.5, "pid": 42}).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sys/unix"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
)

// The scope and tables of the example's fenced writes (kopf_reconcile.fencing.postgres).
const (
	scope      = "devices.example.com-reconcile-device"
	fenceTable = "kopf_reconcile_fence"
	epochs     = "kopf_reconcile_fence_epochs"
)

var deviceKind = schema.GroupVersionKind{Group: "example.com", Version: "v1", Kind: "Device"}

var powerStates = map[string]bool{"on": true, "off": true, "standby": true}

// The statement PostgresFencedRepository.apply_fenced sends for a JSON document.
const upsert = `
WITH led AS (SELECT epoch FROM ` + epochs + ` WHERE scope = $1 FOR SHARE)
INSERT INTO ` + fenceTable + ` AS fence
    (scope, entity_id, tenant, last_epoch, state, updated_at)
SELECT $1, $2, $3, $4, $5::jsonb, now()
 WHERE $4 >= coalesce((SELECT epoch FROM led), 0)
ON CONFLICT (scope, entity_id) DO UPDATE
   SET last_epoch = EXCLUDED.last_epoch,
       state = COALESCE(EXCLUDED.state, fence.state),
       updated_at = EXCLUDED.updated_at
 WHERE fence.last_epoch <= $4
RETURNING true`

// The tables as the repository creates them (the columns the statement uses).
var schemaStatements = []string{
	`CREATE TABLE IF NOT EXISTS ` + fenceTable + ` (
		scope text NOT NULL, entity_id text NOT NULL, tenant text NOT NULL,
		last_epoch bigint NOT NULL CHECK (last_epoch >= 0), state jsonb,
		updated_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (scope, entity_id))`,
	`CREATE TABLE IF NOT EXISTS ` + epochs + ` (
		scope text PRIMARY KEY, epoch bigint NOT NULL CHECK (epoch >= 0), lease text, holder text)`,
	`INSERT INTO ` + epochs + ` (scope, epoch) VALUES ('` + scope + `', 0) ON CONFLICT DO NOTHING`,
}

type events struct {
	enabled bool
	mu      sync.Mutex
	leading bool
	first   bool
}

func (e *events) emit(name string) {
	if !e.enabled {
		return
	}
	var clock unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &clock); err != nil {
		panic(err)
	}
	now := float64(clock.Nano()) / 1e9
	line, _ := json.Marshal(map[string]any{"event": name, "t": now, "pid": os.Getpid()})
	fmt.Println(string(line))
}

func (e *events) elected() {
	e.mu.Lock()
	e.leading = true
	e.mu.Unlock()
	e.emit("leader")
}

func (e *events) reconciled() {
	e.mu.Lock()
	first := e.leading && !e.first
	e.first = e.first || first
	e.mu.Unlock()
	if first {
		e.emit("reconcile")
	}
}

type deviceReconciler struct {
	client    client.Client
	pool      *pgxpool.Pool
	workDelay time.Duration
	events    *events
}

func (r *deviceReconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	r.events.reconciled()
	entity := req.Namespace + "/" + req.Name
	device := &unstructured.Unstructured{}
	device.SetGroupVersionKind(deviceKind)
	if err := r.client.Get(ctx, req.NamespacedName, device); err != nil {
		if apierrors.IsNotFound(err) {
			return reconcile.Result{}, r.write(ctx, entity, req.Namespace, map[string]any{"deleted": true})
		}
		return reconcile.Result{}, err
	}
	desired, _, _ := unstructured.NestedFieldNoCopy(device.Object, "spec", "desired")
	state, ok := desired.(string)
	if !ok || !powerStates[state] {
		// Retrying cannot help: the example dead-letters it until the spec changes.
		return reconcile.Result{}, reconcile.TerminalError(fmt.Errorf(
			"Device %s: spec.desired must be one of on, off, standby, got %v", entity, desired))
	}
	generation := device.GetGeneration()
	observed, _, _ := unstructured.NestedFieldNoCopy(device.Object, "status", "observed")
	observedGeneration, _, _ := unstructured.NestedInt64(device.Object, "status", "observedGeneration")
	if observed == state && observedGeneration == generation {
		return reconcile.Result{}, nil // already converged
	}
	if r.workDelay > 0 {
		select {
		case <-time.After(r.workDelay):
		case <-ctx.Done():
			return reconcile.Result{}, ctx.Err()
		}
	}
	if err := r.write(ctx, entity, req.Namespace, map[string]any{"desired": state, "generation": generation}); err != nil {
		return reconcile.Result{}, err
	}
	status := map[string]any{"observed": state, "epoch": 0, "observedGeneration": generation}
	patch, err := json.Marshal([]map[string]any{{"op": "add", "path": "/status", "value": status}})
	if err != nil {
		return reconcile.Result{}, err
	}
	err = r.client.Status().Patch(ctx, device, client.RawPatch(types.JSONPatchType, patch))
	return reconcile.Result{}, client.IgnoreNotFound(err)
}

func (r *deviceReconciler) write(ctx context.Context, entity, tenant string, document map[string]any) error {
	encoded, err := json.Marshal(document)
	if err != nil {
		return err
	}
	var accepted bool
	err = r.pool.QueryRow(ctx, upsert, scope, entity, tenant, int64(0), string(encoded)).Scan(&accepted)
	if err != nil && !errors.Is(err, pgxNoRows) {
		return fmt.Errorf("writing %s: %w", entity, err)
	}
	return nil
}

// createTables makes the tables once, whichever replica comes first (the lock serialises
// replicas that start together: CREATE TABLE IF NOT EXISTS alone races).
func createTables(ctx context.Context, pool *pgxpool.Pool) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after the commit
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('`+fenceTable+`'))`); err != nil {
		return err
	}
	for _, statement := range schemaStatements {
		if _, err := tx.Exec(ctx, statement); err != nil {
			return err
		}
	}
	return tx.Commit(ctx)
}

func workDelay() (time.Duration, error) {
	raw := os.Getenv("DEVICES_WORK_DELAY")
	if raw == "" {
		return 0, nil
	}
	seconds, err := strconv.ParseFloat(raw, 64)
	if err != nil || seconds < 0 || seconds >= 60 {
		return 0, fmt.Errorf("DEVICES_WORK_DELAY must be seconds in [0, 60), got %q", raw)
	}
	return time.Duration(seconds * float64(time.Second)), nil
}

func main() {
	var (
		namespace      = flag.String("namespace", "default", "the namespace whose Devices are reconciled")
		metricsAddress = flag.String("metrics-bind-address", "127.0.0.1:8080", `the metrics endpoint ("0": none)`)
		leaderElect    = flag.Bool("leader-elect", true, "elect a leader on a Lease")
		electionID     = flag.String("leader-election-id", "devices-controller-runtime", "the Lease's name")
		leaseDuration  = flag.Duration("lease-duration", 15*time.Second, "the Lease's duration")
		renewDeadline  = flag.Duration("renew-deadline", 10*time.Second, "how long the leader retries renewing")
		retryPeriod    = flag.Duration("retry-period", 2*time.Second, "between attempts to acquire or renew")
		releaseOnStop  = flag.Bool("leader-election-release-on-cancel", false, "give the Lease up on a graceful stop")
		concurrency    = flag.Int("concurrency", 8, "reconciles at once (the example's concurrency)")
		withEvents     = flag.Bool("events", false, "print leadership and first-reconcile events on stdout")
		verbose        = flag.Bool("verbose", false, "log at debug level")
	)
	flag.Parse()
	ctrl.SetLogger(zap.New(zap.UseDevMode(*verbose)))
	log := ctrl.Log.WithName("devices")
	if err := run(*namespace, *metricsAddress, *leaderElect, *electionID, *leaseDuration,
		*renewDeadline, *retryPeriod, *releaseOnStop, *concurrency, *withEvents); err != nil {
		log.Error(err, "stopped")
		os.Exit(1)
	}
}

func run(namespace, metricsAddress string, leaderElect bool, electionID string,
	leaseDuration, renewDeadline, retryPeriod time.Duration, releaseOnStop bool,
	concurrency int, withEvents bool) error {
	delay, err := workDelay()
	if err != nil {
		return err
	}
	dsn := os.Getenv("KOPF_RECONCILE_DATABASE_URL")
	if dsn == "" {
		return errors.New("KOPF_RECONCILE_DATABASE_URL is not set")
	}
	ctx := ctrl.SetupSignalHandler()
	config, err := ctrl.GetConfig()
	if err != nil {
		return err
	}
	// JSON on the wire, as the Python operators use (custom resources are JSON anyway).
	config.ContentType = runtime.ContentTypeJSON
	config.AcceptContentTypes = runtime.ContentTypeJSON
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := createTables(ctx, pool); err != nil {
		return fmt.Errorf("creating the tables: %w", err)
	}
	manager, err := ctrl.NewManager(config, ctrl.Options{
		Cache: cache.Options{DefaultNamespaces: map[string]cache.Config{namespace: {}}},
		// Reads from the informer's cache, as a typed object's are: a Device is unstructured
		// here only because this module has no generated types for it.
		Client:                        client.Options{Cache: &client.CacheOptions{Unstructured: true}},
		Metrics:                       metricsserver.Options{BindAddress: metricsAddress},
		HealthProbeBindAddress:        "0",
		LeaderElection:                leaderElect,
		LeaderElectionID:              electionID,
		LeaderElectionNamespace:       namespace,
		LeaderElectionResourceLock:    "leases",
		LeaderElectionReleaseOnCancel: releaseOnStop,
		LeaseDuration:                 &leaseDuration,
		RenewDeadline:                 &renewDeadline,
		RetryPeriod:                   &retryPeriod,
	})
	if err != nil {
		return err
	}
	report := &events{enabled: withEvents}
	device := &unstructured.Unstructured{}
	device.SetGroupVersionKind(deviceKind)
	err = ctrl.NewControllerManagedBy(manager).
		Named("device").
		For(device, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		WithOptions(controller.Options{MaxConcurrentReconciles: concurrency}).
		Complete(&deviceReconciler{client: manager.GetClient(), pool: pool, workDelay: delay, events: report})
	if err != nil {
		return err
	}
	go func() {
		select {
		case <-manager.Elected():
			report.elected()
		case <-ctx.Done():
		}
	}()
	return manager.Start(ctx)
}

// pgxNoRows: a write the statement's epoch checks refused returns no row.
var pgxNoRows = pgx.ErrNoRows
