/* llama.cpp's own negative log-likelihood of token windows, for benchmarks/quantization.py's
 * "llama.cpp ppl" column: the GGUF file read and run by llama.cpp, every position of each
 * window predicting the next, as glassformer's perplexity() scores it. (llama-perplexity
 * scores only the second half of each window, so its figure is another quantity.)
 *
 *   llama-window-ppl MODEL.gguf THREADS < windows.txt
 *
 * stdin: one window per line, its token ids separated by spaces (the caller's tokenizer: the
 * same ids glassformer scores). stdout: one line per window, "NLL TARGETS": the sum over its
 * positions i < n - 1 of -log softmax(logits_i)[id_{i+1}], in double, and n - 1. Each window
 * starts on an empty cache. build_llama_cpp.sh compiles it against the libraries it built. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

#define MAX_WINDOW 8192

static void quiet(enum ggml_log_level level, const char *text, void *data) {
    (void)data;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

/* -log softmax(logits)[target], with the maximum subtracted first */
static double nll(const float *logits, int n_vocab, int target) {
    float top = logits[0];
    for (int v = 1; v < n_vocab; ++v) top = logits[v] > top ? logits[v] : top;
    double sum = 0.0;
    for (int v = 0; v < n_vocab; ++v) sum += exp((double)logits[v] - top);
    return log(sum) + top - logits[target];
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODEL.gguf THREADS < windows.txt\n", argv[0]);
        return 2;
    }
    const int threads = atoi(argv[2]);
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params model_params = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], model_params);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    struct llama_context_params params = llama_context_default_params();
    params.n_ctx = params.n_batch = params.n_ubatch = MAX_WINDOW;
    params.n_threads = params.n_threads_batch = threads;
    struct llama_context *ctx = llama_init_from_model(model, params);
    if (!ctx) {
        fprintf(stderr, "cannot make a context of %d tokens\n", MAX_WINDOW);
        return 1;
    }
    struct llama_batch batch = llama_batch_init(MAX_WINDOW, 0, 1);
    static llama_token ids[MAX_WINDOW];
    static char line[16 * MAX_WINDOW];
    while (fgets(line, sizeof line, stdin)) {
        int n = 0;
        for (char *word = strtok(line, " \n"); word; word = strtok(NULL, " \n")) {
            if (n == MAX_WINDOW) {
                fprintf(stderr, "a window is longer than %d tokens\n", MAX_WINDOW);
                return 1;
            }
            ids[n++] = atoi(word);
        }
        if (n < 2) continue;
        llama_memory_clear(llama_get_memory(ctx), true);
        batch.n_tokens = n;
        for (int i = 0; i < n; ++i) {
            batch.token[i] = ids[i];
            batch.pos[i] = i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1; /* every position's logits */
        }
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "llama_decode failed on a window of %d tokens\n", n);
            return 1;
        }
        double total = 0.0;
        for (int i = 0; i < n - 1; ++i) total += nll(llama_get_logits_ith(ctx, i), n_vocab, ids[i + 1]);
        printf("%.10f %d\n", total, n - 1);
        fflush(stdout);
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
