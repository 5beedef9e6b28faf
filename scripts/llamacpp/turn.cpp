// The catalog scenario of `kvsnap bench catalog`, on llama.cpp: prefill the prefix once, save its
// sequence state, then per turn restore the state, decode the utterance and run greedy steps.
// Greedy is an argmax over the logits, as in kvsnap. Prints a line per turn and writes JSON with
// the catalog bench's key names.
//
//   turn MODEL.gguf DIR OUT.json [turns=20] [steps=15] [threads=all]
//
// DIR holds prefix.ids, utterance.ids and greedy.ids (`kvsnap bench workload --ids-out DIR`).
#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace {

// Timed prefills of the prefix, the median reported (as `kvsnap bench catalog`'s default).
constexpr int kPrefillReps = 3;

[[noreturn]] void fail(const std::string &what) {
    std::fprintf(stderr, "turn: %s\n", what.c_str());
    std::exit(1);
}

std::vector<llama_token> read_ids(const std::string &path) {
    std::ifstream in(path);
    if (!in) fail("cannot read " + path);
    std::vector<llama_token> ids;
    for (int id; in >> id;) ids.push_back(id);
    if (ids.empty()) fail(path + " holds no ids");
    return ids;
}

double seconds() {
    using clock = std::chrono::steady_clock;
    return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

// Decodes `tokens` after what the context holds; returns the argmax of the last position's logits.
llama_token decode(llama_context *ctx, std::vector<llama_token> tokens, int n_vocab) {
    if (llama_decode(ctx, llama_batch_get_one(tokens.data(), int(tokens.size()))) != 0)
        fail("llama_decode failed");
    const float *logits = llama_get_logits_ith(ctx, -1);
    return llama_token(std::max_element(logits, logits + n_vocab) - logits);
}

// Nearest-rank percentile, as kvsnap's bench computes it.
double percentile(std::vector<double> values, double p) {
    std::sort(values.begin(), values.end());
    auto rank = size_t(std::ceil(p / 100.0 * double(values.size())));
    return values[std::clamp<size_t>(rank, 1, values.size()) - 1];
}

}  // namespace

int main(int argc, char **argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: turn MODEL.gguf DIR OUT.json [turns] [steps] [threads]\n");
        return 2;
    }
    const std::string dir = argv[2];
    const int turns = argc > 4 ? std::atoi(argv[4]) : 20;
    const int steps = argc > 5 ? std::atoi(argv[5]) : 15;
    const int threads = argc > 6 ? std::atoi(argv[6]) : int(std::thread::hardware_concurrency());
    const auto prefix = read_ids(dir + "/prefix.ids");
    const auto utterance = read_ids(dir + "/utterance.ids");
    const auto greedy = read_ids(dir + "/greedy.ids");

    llama_backend_init();
    llama_model *model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) fail(std::string("cannot load ") + argv[1]);
    auto params = llama_context_default_params();
    params.n_ctx = 1024;
    params.n_batch = params.n_ubatch = 1024;  // the prefix in one batch
    params.n_threads = params.n_threads_batch = threads;
    llama_context *ctx = llama_init_from_model(model, params);
    if (!ctx) fail("cannot create a context");
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_memory_t memory = llama_get_memory(ctx);

    // Warm-up: page the weights in and let the threads start.
    decode(ctx, {prefix.begin(), prefix.begin() + 8}, n_vocab);

    std::vector<double> prefills;
    double t = 0;
    for (int rep = 0; rep < kPrefillReps; rep++) {
        llama_memory_seq_rm(memory, -1, -1, -1);
        t = seconds();
        decode(ctx, prefix, n_vocab);
        prefills.push_back(seconds() - t);
    }
    const double prefill_s = percentile(prefills, 50);
    t = seconds();
    std::vector<uint8_t> state(llama_state_seq_get_size(ctx, 0));
    if (llama_state_seq_get_data(ctx, state.data(), state.size(), 0) != state.size())
        fail("saving the sequence state failed");
    const double snapshot_s = seconds() - t;
    std::printf("prefix %zu tokens: prefill %.3f s (median of %d); state %.1f MB saved in %.2f ms\n",
                prefix.size(), prefill_s, kPrefillReps, double(state.size()) / 1e6, snapshot_s * 1e3);

    std::vector<double> totals, restores, extends, step_times;
    std::vector<llama_token> produced;
    for (int turn = 1; turn <= turns; turn++) {
        const double t0 = seconds();
        llama_memory_seq_rm(memory, 0, -1, -1);
        if (llama_state_seq_set_data(ctx, state.data(), state.size(), 0) == 0)
            fail("restoring the sequence state failed");
        restores.push_back(seconds() - t0);
        t = seconds();
        llama_token next = decode(ctx, utterance, n_vocab);
        extends.push_back(seconds() - t);
        std::vector<llama_token> tokens{next};
        for (int s = 0; s < steps; s++) {
            t = seconds();
            next = decode(ctx, {next}, n_vocab);
            step_times.push_back(seconds() - t);
            tokens.push_back(next);
        }
        totals.push_back(seconds() - t0);
        std::printf("turn %d/%d: %.3f s (restore %.2f ms, extend %.1f ms)\n", turn, turns,
                    totals.back(), restores.back() * 1e3, extends.back() * 1e3);
        if (turn == 1) produced = tokens;
        else if (tokens != produced) fail("turns restored from one state produced different tokens");
    }
    size_t agree = 0;
    while (agree < produced.size() && agree < greedy.size() && produced[agree] == greedy[agree]) agree++;

    const double p50 = percentile(totals, 50), p90 = percentile(totals, 90);
    const double step = percentile(step_times, 50);
    std::printf("turn p50 %.3f s, p90 %.3f s; decode step p50 %.2f ms (%.1f tok/s); "
                "greedy tokens equal to the oracle's: %zu/%zu\n",
                p50, p90, step * 1e3, 1.0 / step, agree, produced.size());

    FILE *out = std::fopen(argv[3], "w");
    if (!out) fail(std::string("cannot write ") + argv[3]);
    std::fprintf(out, "{\"backend\": \"llama.cpp\", \"prefix_prefill_runs_s\": [");
    for (size_t i = 0; i < prefills.size(); i++) std::fprintf(out, "%s%.6f", i ? ", " : "", prefills[i]);
    std::fprintf(out,
                 "], \"threads\": %d, \"prefix_tokens\": %zu, "
                 "\"prefix_prefill_s\": %.6f, \"snapshot_s\": %.6f, \"state_bytes\": %zu, "
                 "\"turns\": %d, \"turn_steps\": %d, \"extend_tokens\": %zu, \"restore_s\": %.6f, "
                 "\"extend_s\": %.6f, \"decode_step_s\": %.6f, \"turn_p50_s\": %.6f, "
                 "\"turn_p90_s\": %.6f, \"greedy_agree\": %zu, \"greedy_of\": %zu}\n",
                 threads, prefix.size(), prefill_s, snapshot_s, state.size(), turns, steps,
                 utterance.size(), percentile(restores, 50), percentile(extends, 50), step, p50,
                 p90, agree, produced.size());
    std::fclose(out);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
