// Command decode is a complete gqa.v1 Decode client: it opens a stream, sends steps and checks
// each output against a float64 reference, gets an in-band refusal (and goes on), rolls back,
// takes a snapshot and restores it on a second stream whose next output is bit-identical.
//
//	go run ./example/decode -address 127.0.0.1:50051
//
// It prints one line per stage and "ok" at the end; any mismatch exits with status 1.
package main

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	gqav1 "gqa-serve/clients/go/gqa/v1"
)

// The stream's shape: B=1, Hq=4 query heads over Hkv=2 KV heads (G=2), D=8, greedy W=4, C=6.
const (
	hq, hkv, d = 4, 2, 8
	window     = 4
	capacity   = 6
	layers     = 2
	// Messages up to the server's default limit, both ways (gRPC's own default receive limit
	// is 4 MiB; snapshots ask for chunks under it anyway).
	maxMessage = 64 << 20
	maxChunk   = 4 << 20
)

func main() {
	address := flag.String("address", "127.0.0.1:50051", "host:port of the server")
	steps := flag.Int("steps", 12, "steps to send to layer 0 (more than the window, so it evicts)")
	token := flag.String("token", os.Getenv("GQA_AUTH_TOKEN"), "bearer token, if the server requires one")
	flag.Parse()
	if err := run(*address, *steps, *token); err != nil {
		fmt.Fprintln(os.Stderr, "decode:", err)
		os.Exit(1)
	}
	fmt.Println("ok")
}

func run(address string, steps int, token string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	// WithInsecure: plaintext, as on loopback; use grpc.WithTransportCredentials for TLS.
	conn, err := grpc.DialContext(ctx, address, grpc.WithInsecure(), grpc.WithBlock(),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMessage), grpc.MaxCallSendMsgSize(maxMessage)))
	if err != nil {
		return fmt.Errorf("dial %s: %w", address, err)
	}
	defer conn.Close()
	client := gqav1.NewAttentionServiceClient(conn)

	info, err := client.GetServerInfo(ctx, &gqav1.GetServerInfoRequest{})
	if err != nil {
		return fmt.Errorf("GetServerInfo: %w", err)
	}
	fmt.Printf("server %s, default backend %s\n", info.Version, info.DefaultBackend)

	stream, opened, err := openStream(ctx, client, &gqav1.DecodeRequest{Kind: &gqav1.DecodeRequest_Open{Open: &gqav1.OpenStream{
		Dtype: gqav1.DType_DTYPE_FLOAT32, BatchSize: 1, NumQueryHeads: hq, NumKvHeads: hkv, HeadDim: d,
		NumLayers: layers, Policy: gqav1.EvictionPolicy_EVICTION_POLICY_GREEDY, Window: window, Capacity: capacity,
	}}})
	if err != nil {
		return err
	}
	fmt.Printf("opened %s: backend %s, capacity %d, %d bytes reserved\n", opened.StreamId, opened.Backend,
		opened.Capacity, opened.BytesReserved)

	// Steps: the client keeps every token it sent so it can check each output against a
	// float64 reference over the latest min(T, W) tokens.
	var keys, values [][]float32
	var rid uint64
	var maxErr float64
	for t := 0; t < steps; t++ {
		q, k, v := data(t, 0, hq*d), data(t, 1, hkv*d), data(t, 2, hkv*d)
		keys, values = append(keys, k), append(values, v)
		rid++
		result, err := step(stream, rid, 0, q, k, v)
		if err != nil {
			return err
		}
		if result.Status.GetCode() != 0 {
			return fmt.Errorf("step %d refused: %s", t, result.Status.Message)
		}
		first := len(keys) - window
		if first < 0 {
			first = 0
		}
		want := reference(q, keys[first:], values[first:])
		for i, got := range Float32s(result.Output) {
			maxErr = math.Max(maxErr, math.Abs(float64(got)-want[i]))
		}
		if t == steps-1 {
			fmt.Printf("%d steps: T=%d, L=%d (positions %d..%d), evicted %v, rollback reach %d, compute %d ns\n",
				steps, result.TokensSeen, result.Resident, result.FirstPosition, result.LastPosition, result.Evicted,
				result.RollbackReach, result.ComputeNs)
		}
	}
	fmt.Printf("max |output - float64 reference| = %.2g\n", maxErr)
	if maxErr > 1e-5 {
		return fmt.Errorf("outputs differ from the reference by %g", maxErr)
	}

	// An in-band refusal: a query of the wrong shape. The stream stays open, caches unchanged.
	rid++
	refused, err := step(stream, rid, 0, data(0, 0, 3*d)[:3*d], data(0, 1, hkv*d), data(0, 2, hkv*d))
	if err != nil {
		return err
	}
	if refused.Status.GetCode() != 3 { // INVALID_ARGUMENT
		return fmt.Errorf("a bad step was not refused in-band: %v", refused.Status)
	}
	fmt.Printf("refused in-band (code %d): %s\n", refused.Status.Code, refused.Status.Message)

	// Rollback: one token of layer 0 is within reach; the whole layer is not (evicted tokens).
	rid++
	rolled, err := rollback(stream, rid, 1, 0)
	if err != nil {
		return err
	}
	if rolled.Status.GetCode() != 0 {
		return fmt.Errorf("rollback of 1 refused: %s", rolled.Status.Message)
	}
	keys, values = keys[:len(keys)-1], values[:len(values)-1]
	rid++
	tooFar, err := rollback(stream, rid, uint32(steps), 0)
	if err != nil {
		return err
	}
	if tooFar.Status.GetCode() != 9 { // FAILED_PRECONDITION
		return fmt.Errorf("an inexact rollback was not refused: %v", tooFar.Status)
	}
	fmt.Printf("rolled back 1 (T now %v); %d refused in-band: %s\n", rolled.TokensSeen, steps, tooFar.Status.Message)

	// Snapshot, then restore on a second stream: both must give the same next output.
	rid++
	if err := stream.Send(&gqav1.DecodeRequest{RequestId: rid, Kind: &gqav1.DecodeRequest_Snapshot{
		Snapshot: &gqav1.SnapshotRequest{MaxChunkBytes: maxChunk}}}); err != nil {
		return err
	}
	var chunks []*gqav1.SnapshotChunk
	for {
		resp, err := stream.Recv()
		if err != nil {
			return fmt.Errorf("snapshot: %w", err)
		}
		chunk := resp.GetSnapshot()
		if chunk == nil {
			return fmt.Errorf("snapshot refused: %v", resp.GetError())
		}
		chunks = append(chunks, chunk)
		if chunk.Last {
			break
		}
	}
	restores := make([]*gqav1.DecodeRequest, len(chunks))
	for i, c := range chunks {
		restores[i] = &gqav1.DecodeRequest{Kind: &gqav1.DecodeRequest_Restore{Restore: c}}
	}
	restored, reopened, err := openStream(ctx, client, restores...)
	if err != nil {
		return err
	}
	q, k, v := data(100, 0, hq*d), data(100, 1, hkv*d), data(100, 2, hkv*d)
	rid++
	a, err := step(stream, rid, 0, q, k, v)
	if err != nil {
		return err
	}
	b, err := step(restored, 1, 0, q, k, v)
	if err != nil {
		return err
	}
	if string(a.Output.Data) != string(b.Output.Data) {
		return errors.New("the restored stream's output differs from the original's")
	}
	fmt.Printf("snapshot of %d chunks restored as %s (T %v): next outputs bit-identical\n", len(chunks),
		reopened.StreamId, reopened.TokensSeen)

	// Half-close both streams; the server frees their caches and ends them with OK.
	for _, s := range []gqav1.AttentionService_DecodeClient{stream, restored} {
		if err := closeStream(s); err != nil {
			return err
		}
	}
	return nil
}

// openStream starts a Decode call, sends the opening requests (an open, or a snapshot's restore
// chunks) and reads `opened`; a refused open ends the call with a status, returned as the error.
func openStream(ctx context.Context, client gqav1.AttentionServiceClient, first ...*gqav1.DecodeRequest) (
	gqav1.AttentionService_DecodeClient, *gqav1.StreamOpened, error) {
	// No deadline of its own: a Decode stream lives as long as its sequence (ctx bounds this
	// example as a whole).
	stream, err := client.Decode(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("Decode: %w", err)
	}
	for _, request := range first {
		if err := stream.Send(request); err != nil {
			break // the server ended the call; Recv returns its status
		}
	}
	resp, err := stream.Recv()
	if err != nil {
		return nil, nil, fmt.Errorf("open refused: %w", err)
	}
	return stream, resp.GetOpened(), nil
}

func step(stream gqav1.AttentionService_DecodeClient, rid uint64, layer uint32, q, k, v []float32) (*gqav1.StepResult, error) {
	err := stream.Send(&gqav1.DecodeRequest{RequestId: rid, Kind: &gqav1.DecodeRequest_Step{Step: &gqav1.Step{
		Layer: layer, Query: Float32Tensor(q, 1, int64(len(q)/d), d),
		NewKey: Float32Tensor(k, 1, hkv, d), NewValue: Float32Tensor(v, 1, hkv, d)}}})
	if err != nil {
		return nil, err
	}
	resp, err := stream.Recv()
	if err != nil {
		return nil, fmt.Errorf("step %d: the stream ended: %w", rid, err)
	}
	if resp.RequestId != rid {
		return nil, fmt.Errorf("reply to %d, expected %d", resp.RequestId, rid)
	}
	return resp.GetStep(), nil
}

func rollback(stream gqav1.AttentionService_DecodeClient, rid uint64, count, layer uint32) (*gqav1.RollbackResult, error) {
	err := stream.Send(&gqav1.DecodeRequest{RequestId: rid, Kind: &gqav1.DecodeRequest_Rollback{
		Rollback: &gqav1.Rollback{Count: count, Layer: layer}}})
	if err != nil {
		return nil, err
	}
	resp, err := stream.Recv()
	if err != nil {
		return nil, fmt.Errorf("rollback: the stream ended: %w", err)
	}
	return resp.GetRollback(), nil
}

func closeStream(stream gqav1.AttentionService_DecodeClient) error {
	if err := stream.CloseSend(); err != nil {
		return err
	}
	for {
		if _, err := stream.Recv(); err == io.EOF {
			return nil
		} else if err != nil {
			return err
		}
	}
}

// Float32Tensor packs values as little-endian float32 (row-major), as docs/wire-format.md says.
func Float32Tensor(values []float32, shape ...int64) *gqav1.Tensor {
	data := make([]byte, 4*len(values))
	for i, v := range values {
		binary.LittleEndian.PutUint32(data[4*i:], math.Float32bits(v))
	}
	return &gqav1.Tensor{Dtype: gqav1.DType_DTYPE_FLOAT32, Shape: shape, Data: data}
}

// Float32s reads a float32 tensor's values back.
func Float32s(t *gqav1.Tensor) []float32 {
	out := make([]float32, len(t.Data)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(t.Data[4*i:]))
	}
	return out
}

// data is deterministic test data in [-1, 1).
func data(t, which, n int) []float32 {
	out := make([]float32, n)
	for i := range out {
		x := math.Sin(float64(1+t)*1.7 + float64(which)*3.1 + float64(i)*0.37)
		out[i] = float32(x)
	}
	return out
}

// reference is one step's output in float64: query head h*G+g attends KV head h over the given
// tokens (oldest first), softmax of q.k / sqrt(D), weighted sum of the values.
func reference(q []float32, keys, values [][]float32) []float64 {
	out := make([]float64, hq*d)
	g := hq / hkv
	for head := 0; head < hq; head++ {
		kv := head / g
		scores := make([]float64, len(keys))
		top := math.Inf(-1)
		for s, k := range keys {
			var dot float64
			for i := 0; i < d; i++ {
				dot += float64(q[head*d+i]) * float64(k[kv*d+i])
			}
			scores[s] = dot / math.Sqrt(d)
			top = math.Max(top, scores[s])
		}
		var sum float64
		for s := range scores {
			scores[s] = math.Exp(scores[s] - top)
			sum += scores[s]
		}
		for s, v := range values {
			for i := 0; i < d; i++ {
				out[head*d+i] += scores[s] / sum * float64(v[kv*d+i])
			}
		}
	}
	return out
}
